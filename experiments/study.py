"""Experiment driver: train, evaluate and aggregate a named study of routed-model runs (issue 14).

    python experiments/study.py run STUDY.yaml [--only NAME ...] [--seeds 0 1 2] [--no-aggregate] [--dry-run]
    python experiments/study.py aggregate OUT_DIR [--in-training]
    python experiments/study.py status OUT_DIR
    python experiments/study.py show STUDY.yaml

Run it from the repository root: every relative path in the study file and in the configs it names is relative to
the working directory, which is also where the training and held-out evaluation run. This file is the command line
of the ``experiments`` package: the study file's schema is in ``experiments/spec.py`` (runs composed from named
parts: ``experiments/parts.py``), what ``run`` does for each (run, seed) and the result JSON in
``experiments/driver.py``, the page ``aggregate`` writes in ``experiments/pages.py``.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script, Python puts this folder first on sys.path, where the package's modules would shadow any
# top-level module of their names; the checkout goes there instead (its torchtune_dtf and benchmarks first).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from experiments import StudyError  # noqa: E402


def cmd_aggregate(args: argparse.Namespace) -> int:
    from experiments.pages import aggregate

    aggregate(Path(args.out_dir), in_training=args.in_training)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print, per run of the study, which seeds finished (result JSON), which are training on this machine and at
    which step (read from their logs, as ``aggregate --in-training`` reads them) and which have not started."""
    from experiments.results import in_training_results, load_results

    out_dir = Path(args.out_dir)
    spec, finished = load_results(out_dir)
    if not spec:
        raise StudyError(f"{out_dir}/study.json not found: `python experiments/study.py run` writes it")
    training = in_training_results(spec, finished)
    seeds = [int(seed) for seed in spec.get("seeds", [])]
    totals = {"finished": 0, "training": 0, "not started": 0}
    lines = []
    for run in spec["runs"]:
        name = run["name"]
        done = sorted(r["seed"] for r in finished.get(name, []))
        running = {p["seed"]: p for p in training.get(name, [])}
        waiting = [seed for seed in seeds if seed not in done and seed not in running]
        parts = [f"finished {done}" if done else None]
        for seed, partial in sorted(running.items()):
            of = f" of {partial['planned_steps']}" if partial.get("planned_steps") else ""
            parts.append(f"seed {seed} training (step {partial['steps']}{of})")
        parts.append(f"not started {waiting}" if waiting else None)
        totals["finished"] += len(done)
        totals["training"] += len(running)
        totals["not started"] += len(waiting)
        lines.append(f"  {name}: " + "; ".join(p for p in parts if p))
    print(f"{spec.get('name', out_dir.name)} ({out_dir}): "
          + ", ".join(f"{count} {state}" for state, count in totals.items()) + f" of {len(spec['runs'])} runs × seeds {seeds}")
    print("\n".join(lines))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print every run as the study resolves it (name, config, overrides) and its closed-form FLOP ratio as
    planned (each routed layer at its γ), one JSON line per run; nothing is trained."""
    from omegaconf import OmegaConf

    from torchtune_dtf import closed_form
    from experiments.spec import load_study

    study = load_study(Path(args.study))
    root = Path(study["_root"])
    for run in study["runs"]:
        cfg = OmegaConf.load(run["config"])
        for key, value in run["overrides"].items():
            OmegaConf.update(cfg, key, value, force_add=True)
        model = OmegaConf.to_container(cfg.model, resolve=True)
        ratio = closed_form.model_config_flop_ratio(model, int(study["heldout"]["seq_len"]))
        config = Path(run["config"])
        shown = str(config.relative_to(root)) if config.is_relative_to(root) else str(config)
        print(json.dumps({"name": run["name"], "config": shown, "overrides": run["overrides"],
                          "planned_flops_ratio": round(ratio, 4)}))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    from experiments.driver import cmd_run

    parser = argparse.ArgumentParser(prog="python experiments/study.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and evaluate every (run, seed) of a study that has no result JSON yet")
    run.add_argument("study", help="study YAML")
    run.add_argument("--only", nargs="+", metavar="NAME", help="only these runs")
    run.add_argument("--seeds", nargs="+", type=int, help="these seeds instead of the study's")
    run.add_argument("--no-aggregate", action="store_true", help="do not rewrite <out_dir>/README.md afterwards")
    run.add_argument("--dry-run", action="store_true", help="print the training commands, run nothing")
    run.add_argument("--rerun-stale", action="store_true",
                     help="retrain finished runs whose study definition changed since (default: report them and fail)")
    run.set_defaults(fn=cmd_run)
    agg = sub.add_parser("aggregate", help="write <out_dir>/README.md and the plots from the run JSONs")
    agg.add_argument("out_dir")
    agg.add_argument("--in-training", action="store_true",
                     help="also show, in the gaps section, the runs still training here (read from their logs)")
    agg.set_defaults(fn=cmd_aggregate)
    status = sub.add_parser("status", help="which (run, seed)s finished, which train here (and at which step), which wait")
    status.add_argument("out_dir")
    status.set_defaults(fn=cmd_status)
    show = sub.add_parser("show", help="print the study's runs as their parts resolve them (nothing is trained)")
    show.add_argument("study", help="study YAML")
    show.set_defaults(fn=cmd_show)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
