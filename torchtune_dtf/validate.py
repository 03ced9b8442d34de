"""Check a ``routed_finetune`` config as the recipe does at start-up, without training.

    python -m torchtune_dtf.validate configs/stt_qwen0_5b.yaml [key=value ...]

Overrides are merged as ``tune run`` merges them (``device=cpu``, ``resume_from_checkpoint=True``, ``~key``). It runs the
recipe's constructor and ``setup``: every required key and value, the model build (activation checkpointing,
LoRA, compile as configured), the checkpoint load (config.json, weights, routing sidecar), tokenizer, data
files and their rows, the number of steps, and with ``resume_from_checkpoint`` every resume check (finished
run, run id, changed settings). It writes nothing but an empty ``output_dir`` (the checkpointer creates it):
metrics go to stdout and the run is not started, so a later resume of a real run is unaffected.
Exit status 0 when the recipe would start, 1 with its error otherwise.
"""

import argparse
import sys
from typing import List, Optional

from omegaconf import OmegaConf
from torchtune.config._utils import _get_component_from_path

from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.recipes.stock import merge_overrides


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtune_dtf.validate", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="a routed_finetune YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for tune run")
    args = parser.parse_args(argv)
    try:
        # tune run's own merge, so that every override the README shows checks here as the recipe will see it.
        cfg = merge_overrides(OmegaConf.to_container(OmegaConf.load(args.config), resolve=False), args.overrides)
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
        if "metric_logger" in cfg:
            _get_component_from_path(cfg.metric_logger._component_)  # the configured logger exists
            cfg.metric_logger = {"_component_": "torchtune.training.metric_logging.StdoutLogger"}
        recipe = RoutedFinetuneRecipe(cfg)
        recipe.setup(cfg)
    except Exception as err:  # report what the recipe would have failed with, then fail
        print(f"FAILED {args.config}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    trainable = sum(p.numel() for p in recipe._model.parameters() if p.requires_grad)
    start = f"resumes at step {recipe.global_step}" if recipe._resume_from_checkpoint else "starts a new run"
    print(
        f"OK {args.config}: {recipe._variant} model, {trainable:,} trainable parameters, {recipe._total_steps} "
        f"optimizer steps ({recipe._steps_per_epoch} per epoch × {recipe.total_epochs}); the recipe {start}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
