"""Token choice *after* training: is a trained routed model held back by the tokens it chooses, or by its weights?

``oracle_probe.py`` asks this of the pretrained model; this probe asks it of a run the study trained (its
checkpoint kept). On the same held-out windows it scores the trained weights in the run's own shape with

- ``student``: the deployed model, its causal routers deciding (what the study reports);
- ``teacher``: its surprise top-k at γ and β = ``--beta`` (training's choice);
- ``oracle`` / ``random``: each routed layer runs the ⌊γT⌋ tokens of largest true update in hindsight, or random
  ones (``oracle_probe.shape_loss`` on the trained backbone, skipped and dropped layers' tokens receiving the run's
  learned skip bias where it has one; ``oracle, no skip bias`` without it);
- ``routed layers dense``: every routed layer runs every token, the dropped layers still dropped (more FLOPs: what
  the routed layers' skipping costs the trained weights).

If hindsight scores no better than the model's own choice, better routers cannot close a gap to layer dropping;
the trained weights in that shape are the limit. The run's checkpoint must hold the backbone with the dense keys
(routed layers keep TorchTune's attention/MLP names), so the dense config's model loads it.

    python experiments/frontier/trained_probe.py --dense-config configs/quickstart/dense_smollm2.yaml \
        --text quickstart_work/corpus/heldout.jsonl --windows 16 --seq-len 256 \
        --json experiments/frontier/trained_probe.json --markdown experiments/frontier/trained_probe.md \
        --runs quickstart_work/studies/<study>/runs/<run>__seed0 ...
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List

import torch
from omegaconf import OmegaConf
from torchtune import config

sys.path.insert(0, str(Path(__file__).parent))  # oracle_probe beside this file (it adds the repo root)

from oracle_probe import Shape, shape_loss  # noqa: E402
from torchtune_dtf.evaluation.routing_report import heldout_loss, heldout_windows, load_trained  # noqa: E402
from torchtune_dtf.modules import RoutingContext  # noqa: E402

CHOICES = ("student", "teacher", "oracle", "random", "oracle, no skip bias", "routed layers dense")


def trained_shape(model_cfg) -> Shape:
    """The run's shape from its saved ``model`` config: dropped and routed layers, γ per routed layer."""
    routed = [int(i) for i in model_cfg.routed_layers]
    capacity = model_cfg.capacity
    capacity = [float(c) for c in capacity] if OmegaConf.is_list(capacity) else [float(capacity)] * len(routed)
    return Shape("trained", dropped=tuple(int(i) for i in model_cfg.dropped_layers), routed=tuple(routed),
                 capacity=capacity, skipped_tokens_write_kv=bool(model_cfg.skipped_tokens_write_kv))


def skip_biases(model, shape: Shape) -> Dict[int, torch.Tensor]:
    """{layer: [d]} the learned constant update of each dropped or routed layer that has one (``skip_update: bias``)."""
    return {i: model.layers[i].skip_bias.update.detach().clone() for i in (*shape.dropped, *shape.routed)
            if getattr(model.layers[i], "skip_bias", None) is not None}


def probe_run(run_dir: Path, dense, windows: torch.Tensor, beta: float, batch_size: int) -> Dict[str, float]:
    """Held-out loss per token of one trained run under each of ``CHOICES``."""
    cfg = OmegaConf.load(run_dir / "torchtune_config.yaml")
    routed_model = load_trained(cfg, run_dir / "epoch_0")
    shape = trained_shape(cfg.model)
    biases = skip_biases(routed_model, shape)
    missing, _ = dense.load_state_dict(routed_model.state_dict(), strict=False)  # routing tensors are extra
    if missing:
        raise ValueError(f"{run_dir}: the checkpoint lacks backbone weights the dense model needs: {missing[:5]}")
    dropped_only = Shape("routed layers dense", dropped=shape.dropped)
    return {
        "student": heldout_loss(routed_model, windows, RoutingContext(mode="student"), batch_size),
        "teacher": heldout_loss(routed_model, windows, RoutingContext(mode="teacher", beta_ce=beta, beta_cu=beta),
                                batch_size),
        "oracle": shape_loss(dense, windows, shape, "oracle", batch_size, 0, skip_updates=biases)["loss"],
        "random": shape_loss(dense, windows, shape, "random", batch_size, 0, skip_updates=biases)["loss"],
        "oracle, no skip bias": shape_loss(dense, windows, shape, "oracle", batch_size, 0)["loss"],
        "routed layers dense": shape_loss(dense, windows, dropped_only, "oracle", batch_size, 0,
                                          skip_updates={i: biases[i] for i in shape.dropped if i in biases})["loss"],
    }


def markdown(result: Dict) -> List[str]:
    """One row per choice: mean ± std over the runs, and the choice minus the student per run."""
    rows = result["runs"]
    def spread(xs: List[float]) -> str:
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"

    lines = ["| choice | held-out loss (mean ± std) | − student (mean ± std) | per run |", "|---|---|---|---|"]
    for choice in CHOICES:
        values = [r["loss"][choice] for r in rows]
        deltas = [r["loss"][choice] - r["loss"]["student"] for r in rows]
        lines.append(f"| {choice} | {spread(values)} | {spread(deltas)} | {', '.join(f'{v:.3f}' for v in values)} |")
    return lines


def markdown_page(result: Dict) -> str:
    """The table with what was measured, for ``--markdown``."""
    names = ", ".join(f"`{r['run']}`" for r in result["runs"])
    return "\n".join([
        "# Token choice after training", "",
        "Written by `python experiments/frontier/trained_probe.py` (its docstring says what it does): held-out loss "
        f"per token on {result['windows']} windows of {result['seq_len']} tokens of `{result['text']}` (the study's "
        f"held-out windows) of the trained runs {names}, each in its own shape with the tokens each choice picks; "
        f"the teacher at β {result['beta']:g}.", "", *markdown(result)]) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dense-config", required=True, help="the dense training config (model, tokenizer, checkpointer)")
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--windows", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--beta", type=float, default=100.0, help="the teacher's β (the configs' beta_*_end)")
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="trained run folders (epoch_0 kept)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--markdown", type=Path, help="also the table, with what was measured")
    args = parser.parse_args(argv)
    dense_cfg = OmegaConf.load(args.dense_config)
    dense = load_trained(dense_cfg, dense_cfg.checkpointer.checkpoint_dir)
    windows = heldout_windows(config.instantiate(dense_cfg.tokenizer), args.text, args.seq_len, args.windows)
    runs = []
    for run_dir in args.runs:
        loss = probe_run(run_dir, dense, windows, args.beta, args.batch_size)
        runs.append({"run": run_dir.name, "loss": loss})
        print(run_dir.name, {k: round(v, 4) for k, v in loss.items()}, flush=True)
    result = {"dense_config": args.dense_config, "text": str(args.text), "windows": args.windows,
              "seq_len": args.seq_len, "beta": args.beta, "runs": runs}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(markdown(result)))
    if args.markdown:
        args.markdown.write_text(markdown_page(result))


if __name__ == "__main__":
    main()
