"""Composition with torchtune's stock recipes, for the thin routed wrappers (``routed_generate.py``,
``routed_eval.py``): load a stock recipe module as ``tune run <name>`` would run it, and report what the
routed layers executed while it ran; and what this package's recipes share with the stock ones: the
config-printing rule (:func:`log_config_if_asked`) and ``tune run``'s command line (:func:`parse`, with
:func:`merge_overrides` explaining the one override OmegaConf cannot merge).

torchtune's ``recipes/`` folder is not importable as a package (its ``__init__.py`` raises), so the
module is loaded from the file ``tune run`` itself resolves (``<torchtune's parent>/recipes/<file>`` from
torchtune's recipe registry). Each call loads a private copy: patching one of its globals (the eval
wrapper's results hook) cannot leak into anyone else's.
"""

import argparse
import copy
import functools
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

import torch
import torchtune
from omegaconf import DictConfig
from torchtune import config
from torchtune._recipe_registry import get_all_recipes
from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _merge_yaml_and_cli_args

from torchtune_dtf.modules.decoder import RoutedTransformerDecoder


def stock_recipe_path(name: str) -> Path:
    """Path of torchtune's built-in recipe ``name`` (e.g. ``"generate"``), the file ``tune run name`` runs."""
    for recipe in get_all_recipes():
        if recipe.name == name:
            return Path(torchtune.__file__).parent.parent / "recipes" / recipe.file_path
    raise ValueError(f"torchtune {torchtune.__version__} has no built-in recipe named {name!r}")


def load_stock_recipe(name: str) -> ModuleType:
    """A fresh module object of torchtune's recipe ``name`` (its ``__main__`` block does not run)."""
    path = stock_recipe_path(name)
    spec = importlib.util.spec_from_file_location(f"torchtune_dtf._stock_recipe_{name.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log_config_if_asked(recipe_name: str, cfg: DictConfig) -> None:
    """The resolved config on the console only with ``print_config=True`` (this package's recipes and wrappers):
    it is 60–110 lines before any output, and the config file the user passed already says it."""
    if cfg.get("print_config", False):
        config.log_config(recipe_name=recipe_name, cfg=cfg)


def merge_overrides(yaml_cfg: Dict[str, Any], overrides: List[str]) -> DictConfig:
    """``yaml_cfg`` (a config as plain containers) with ``key=value`` overrides merged exactly as ``tune run``
    merges them (torchtune's own merge: ``~key`` removes a key, ``key=dotted.path`` on a component sets its
    ``_component_``, ``None`` is null).

    OmegaConf cannot merge into a list, so an override that reaches into a list-valued key (``dataset`` of the
    0.5B configs is the papers' mixture, a list of components) fails with "Cannot merge incompatible container
    types"; that error is re-raised saying how to replace the list instead.
    """
    try:
        return _merge_yaml_and_cli_args(argparse.Namespace(**copy.deepcopy(dict(yaml_cfg))), list(overrides))
    except Exception as err:  # OmegaConf raises TypeError, ValueError or its own errors here
        removed = {o[1:].split("=", 1)[0] for o in overrides if o.startswith("~")}
        touched = {o.split("=", 1)[0].split(".", 1)[0] for o in overrides if not o.startswith("~")}
        lists = sorted(k for k in touched - removed if isinstance(yaml_cfg.get(k), (list, tuple)))
        if not lists:
            raise
        key = lists[0]
        example = (
            f"'~{key}' {key}._component_=torchtune.datasets.text_completion_dataset {key}.source=json "
            f"{key}.data_files=YOUR_TEXT.jsonl {key}.packed=True"
            if key.startswith("dataset") else f"'~{key}' {key}._component_=... {key}.<argument>=..."
        )
        raise ValueError(
            f"`{key}` is a list in this config ({len(yaml_cfg[key])} entries), and a key=value override cannot change "
            f"one entry or turn the list into one component ({err}). Replace the whole list: remove it and give the "
            f"new component key by key, e.g. {example} (README, 'Your own text')."
        ) from err


def parse(recipe_main):
    """torchtune's ``config.parse`` (the same ``--config FILE key=value ...`` command line and merge), with
    :func:`merge_overrides`'s explanation when an override reaches into a list."""

    @functools.wraps(recipe_main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        parser = TuneRecipeArgumentParser(description=recipe_main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        yaml_args, cli_args = parser.parse_known_args()
        sys.exit(recipe_main(merge_overrides(vars(yaml_args), cli_args)))

    return wrapper


def reset_routing_counters(model: torch.nn.Module) -> None:
    """Zero the routed layers' student counters; nothing to do for a model that does not route."""
    if isinstance(model, RoutedTransformerDecoder):
        model.reset_routing_counters()


def run_counting_routing(model: torch.nn.Module, run: Callable[[], Any], counted: str) -> Tuple[str, Dict[str, Any]]:
    """Zero the routed layers' counters, call ``run()`` (the stock recipe's generate or evaluate) and return
    :func:`routing_summary` of exactly that run."""
    reset_routing_counters(model)
    run()
    return routing_summary(model, counted)


def routing_summary(model: torch.nn.Module, counted: str) -> Tuple[str, Dict[str, Any]]:
    """What each routed layer executed since the last reset, as log lines and as a JSON-able dict.

    Reads the counters once (one host transfer). The mean is over routed layers; every routed layer sees
    the same tokens, so it is also the token-weighted mean.

    Args:
        model (torch.nn.Module): the model the stock recipe ran.
        counted (str): which tokens the run fed through the model, said where the fractions are printed
            (e.g. padding that the layers cannot tell apart from text).

    Returns:
        Tuple[str, Dict[str, Any]]: the text to log and ``{"executed_fraction": {layer: f},
        "mean_executed_fraction", "executed_tokens": {layer: n}, "seen_tokens": {layer: n}, "counted"}``.
    """
    counts = model.routing_token_counts() if isinstance(model, RoutedTransformerDecoder) else {}
    if not counts:
        return "executed fraction per routed layer: none (this model has no routed layers)", {
            "executed_fraction": {}, "mean_executed_fraction": None, "executed_tokens": {}, "seen_tokens": {},
            "counted": counted,
        }
    fractions = {idx: executed / seen if seen else math.nan for idx, (executed, seen) in counts.items()}
    mean = sum(fractions.values()) / len(fractions)
    text = (
        "executed fraction per routed layer: "
        + ", ".join(f"{idx}: {fraction:.4f}" for idx, fraction in fractions.items())
        + f"; mean {mean:.4f}\n"
        + "executed/seen tokens per routed layer (student routing): "
        + ", ".join(f"{idx}: {executed}/{seen}" for idx, (executed, seen) in counts.items())
        + f"; counted: {counted}"
    )
    summary = {
        "executed_fraction": fractions,
        "mean_executed_fraction": mean,
        "executed_tokens": {idx: executed for idx, (executed, _) in counts.items()},
        "seen_tokens": {idx: seen for idx, (_, seen) in counts.items()},
        "counted": counted,
    }
    return text, summary
