"""``python -m torchtune_dtf ls | cp | run``: our recipes and configs the way ``tune ls`` / ``tune cp`` / ``tune run``
handle torchtune's, from any directory once the package is installed.

    python -m torchtune_dtf ls                                      # recipes and the configs each takes
    python -m torchtune_dtf cp quickstart/stt_smollm2 my_stt.yaml   # a config, to edit
    python -m torchtune_dtf cp routed_finetune .                    # a recipe file
    python -m torchtune_dtf run routed_finetune --config my_stt.yaml
    python -m torchtune_dtf run --nproc_per_node 2 routed_finetune --config stt_qwen0_5b

``run`` is ``tune run`` with our recipe names resolved to their modules and our config names to the installed files
(any other argument, a path included, is passed through unchanged), so everything ``tune run`` takes (torchrun
options before the recipe, ``key=value`` overrides after the config) works as documented for it. torchtune's own CLI
cannot learn our names (its recipe registry is a fixed list), but it runs a recipe that is not its own as a module,
``torchtune_dtf/recipes/routed_finetune.py`` → ``torchtune_dtf.recipes.routed_finetune``, imported from the
installed package: ``tune run torchtune_dtf/recipes/routed_finetune.py --config FILE`` works from any directory.

A config's name is its path under ``torchtune_dtf/configs/`` without ``.yaml`` (``stt_qwen0_5b``,
``quickstart/stt_smollm2``, ``tiny/stt_train``); the recipe it belongs to follows from where it lives: ``eval/``
and ``*/eval_*`` configs are ``routed_eval``'s (and torchtune's ``eleuther_eval``'s), ``generate/`` and
``*/generate_*`` configs ``routed_generate``'s (and ``generate``'s), every other one ``routed_finetune``'s.
"""

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "configs"
RECIPE_DIR = PACKAGE_DIR / "recipes"


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str

    @property
    def run_name(self) -> str:
        """What to give ``tune run``: it turns a recipe that is not its own into a module name by its path
        (``a/b.py`` → ``a.b``, the text after the last dot dropped as a suffix) and imports that."""
        return f"torchtune_dtf/recipes/{self.path.name}"


RECIPES = (
    Recipe("routed_finetune", RECIPE_DIR / "routed_finetune.py",
           "fine-tune a routed (or dense) model: full or LoRA, one device or FSDP2 (--nproc_per_node)"),
    Recipe("routed_eval", RECIPE_DIR / "routed_eval.py",
           "torchtune's eleuther_eval, then the executed fraction per routed layer"),
    Recipe("routed_generate", RECIPE_DIR / "routed_generate.py",
           "torchtune's generate, then the executed fraction per routed layer"),
)


def recipe_of(config_name: str) -> str:
    """The recipe a config name belongs to (module docstring)."""
    folder, _, stem = config_name.rpartition("/")
    if folder == "eval" or stem.startswith("eval_"):
        return "routed_eval"
    if folder == "generate" or stem.startswith("generate_"):
        return "routed_generate"
    return "routed_finetune"


def configs_by_recipe() -> Dict[str, List[str]]:
    """``{recipe name: [config names]}`` of the shipped configs, sorted."""
    grouped: Dict[str, List[str]] = {recipe.name: [] for recipe in RECIPES}
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        name = path.relative_to(CONFIG_DIR).with_suffix("").as_posix()
        grouped[recipe_of(name)].append(name)
    return grouped


def _recipes() -> Dict[str, Recipe]:
    return {recipe.name: recipe for recipe in RECIPES}


def config_path(name: str) -> Optional[Path]:
    """The installed file of config ``name`` (``.yaml`` optional), or None when it is not one of ours."""
    candidate = CONFIG_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    return candidate if candidate.is_file() and CONFIG_DIR in candidate.resolve().parents else None


def list_recipes(out=sys.stdout) -> None:
    grouped = configs_by_recipe()
    width = max(len(recipe.name) for recipe in RECIPES) + 4
    print(f"{'RECIPE':<{width}}CONFIG", file=out)
    for recipe in RECIPES:
        for i, name in enumerate(grouped[recipe.name] or [""]):
            print(f"{recipe.name if i == 0 else '':<{width}}{name}", file=out)


def copy(name: str, destination: str, *, no_clobber: bool = False, make_parents: bool = False) -> Path:
    """Copy recipe or config ``name`` to ``destination`` (a file, or a folder to copy into) as ``tune cp`` does:
    a destination without a suffix gets the file's (``.py`` or ``.yaml``)."""
    recipe = _recipes().get(name)
    source = recipe.path if recipe is not None else config_path(name)
    if source is None:
        raise ValueError(f"{name!r} is neither a recipe nor a config of torchtune_dtf: `python -m torchtune_dtf ls` "
                         "lists them")
    target = Path(destination)
    if target.is_dir():
        target = target / source.name
    elif not target.suffix:
        target = target.with_suffix(source.suffix)
    if not target.parent.is_dir():
        if not make_parents:
            raise ValueError(f"{target.parent} does not exist: create it or pass --make-parents")
        target.parent.mkdir(parents=True)
    if target.exists() and no_clobber:
        print(f"{target} exists: not overwritten (--no-clobber)")
        return target
    shutil.copyfile(source, target)
    print(f"Copied file to {target}")
    return target


def resolve_run_arguments(arguments: List[str]) -> List[str]:
    """``tune run`` arguments with our recipe names replaced by their module paths and the ``--config`` value (when one of
    our config names and not a file here) by the installed file's path."""
    recipes = _recipes()
    resolved, after_config = [], False
    for argument in arguments:
        if after_config and not Path(argument).is_file() and config_path(argument) is not None:
            argument = str(config_path(argument))
        elif argument in recipes and not after_config:
            argument = recipes[argument].run_name
        after_config = argument == "--config"
        resolved.append(argument)
    return resolved


def run(arguments: List[str]) -> int:
    command = [sys.executable, "-m", "torchtune._cli.tune", "run", *resolve_run_arguments(arguments)]
    return subprocess.call(command)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtune_dtf", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ls", help="list the recipes and the configs each takes")
    cp = commands.add_parser("cp", help="copy a recipe or config to a file or folder")
    cp.add_argument("name", help="recipe name (routed_finetune) or config name (quickstart/stt_smollm2)")
    cp.add_argument("destination")
    cp.add_argument("-n", "--no-clobber", action="store_true", help="do not overwrite an existing file")
    cp.add_argument("--make-parents", action="store_true", help="create the destination's missing folders")
    run_parser = commands.add_parser("run", help="tune run, with our recipe and config names resolved",
                                     add_help=False)
    run_parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "ls":
        list_recipes()
        return 0
    try:
        if args.command == "cp":
            copy(args.name, args.destination, no_clobber=args.no_clobber, make_parents=args.make_parents)
            return 0
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return run(args.arguments)
