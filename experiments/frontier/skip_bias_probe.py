"""What the layer's average update is worth to the tokens that skip it, before any training.

A token that skips a routed layer, or every token at a dropped layer, passes the residual stream on without the
layer's update. Part of that update is the same for every token: its mean. No later layer can add a constant
back (Qwen's MLP and output projections have no bias), so a fine-tune can only approximate it. This probe gives
the skipped tokens of each dropped or routed layer the mean true update of the skipped tokens, measured on the
training text in the same shape and with the same token choice, and compares held-out loss with and without it.
``skip_update: bias`` learns that constant (from zero) in training; this is what its ideal starting value buys.

A third column gives the skipped tokens an update predicted from their own layer input instead, the affine map
``W·rms(x) + b`` fitted by least squares (ridge ``--ridge`` on ``W``) to the same tokens' true updates on the same
training windows (about a tenth of a SmolLM2 block's FLOPs per token it serves; no such option exists in the model
yet: this measures whether one should, see ``experiments/probes/dropped_layer_replacement.py`` for what is left of
it after training).

Shapes and token choices are :mod:`oracle_probe`'s (hindsight and random); the means are measured on
``--train-text`` windows, the losses on the study's held-out windows.

    python experiments/frontier/skip_bias_probe.py --config configs/quickstart/dense_smollm2.yaml \
        --train-text quickstart_work/corpus/train.jsonl --text quickstart_work/corpus/heldout.jsonl \
        --windows 16 --seq-len 256 --linear-rounds 3 \
        --json experiments/frontier/skip_bias_probe.json --markdown experiments/frontier/skip_bias_probe.md
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from omegaconf import OmegaConf
from torchtune import config

sys.path.insert(0, str(Path(__file__).parent))
from oracle_probe import SELECTIONS, SHAPES, SkippedUpdateSums, shape_loss  # noqa: E402

from torchtune_dtf.evaluation.routing_report import heldout_windows, load_trained  # noqa: E402

#: The shapes the probe reads (each FLOP level's layer dropping and routed shapes with skipped tokens' K/V).
PROBED = ("layerdrop_4", "stt_d2_bi5", "stt_bi8_graded", "layerdrop_7", "stt_d4_bi7", "stt_50_kv", "layerdrop_10",
          "stt_d6_bi10")


def markdown(probe) -> str:
    lines = ["# The mean skipped update (and a fitted linear one), before training", "",
             "Written by `python experiments/frontier/skip_bias_probe.py` (its docstring says what it does): the "
             "pretrained model with no training in the study's shapes; `none`: skipped tokens get nothing (as "
             "trained so far); `mean update`: the tokens each dropped or routed layer does not run get the mean "
             f"true update of those tokens, measured on {probe['windows']} windows of `{probe['train_text']}` in the "
             f"same shape and token choice; `linear`: they get `W·rms(x) + b` of their own layer input, fitted by "
             f"least squares (ridge {probe['ridge']}) to the same tokens' true updates, once on the trajectory without "
             f"any stand-in (`linear`), and refitted {probe['linear_rounds'] - 1} more times, each on the trajectory "
             f"with the previous fit's maps applied, so a later layer's map sees the inputs it will get (`refitted`). "
             f"Held-out loss per token on {probe['windows']} windows of {probe['seq_len']} tokens of "
             f"`{probe['text']}`.", "",
             "| shape | selection | none | mean update | difference | linear | difference | refitted | difference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in probe["rows"]:
        lines.append(f"| {r['shape']['name']} | {r['selection']} | {r['none']:.3f} | {r['mean_update']:.3f} | "
                     f"{r['mean_update'] - r['none']:+.3f} | {r['linear']:.3f} | {r['linear'] - r['none']:+.3f} | "
                     f"{r['linear_refitted']:.3f} | {r['linear_refitted'] - r['none']:+.3f} |")
    expected = sum(len(SELECTIONS) if s.routed else 1 for s in SHAPES if s.name in PROBED)
    if len(probe["rows"]) < expected:  # the page is rewritten after every row: a run still going, or stopped
        lines += ["", f"**Partial**: {len(probe['rows'])} of {expected} rows measured."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the dense training config (model, tokenizer, checkpointer)")
    parser.add_argument("--train-text", type=Path, required=True, help="JSONL the means are measured on")
    parser.add_argument("--text", type=Path, required=True, help="JSONL the losses are measured on (held out)")
    parser.add_argument("--windows", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random selection")
    parser.add_argument("--ridge", type=float, default=1e-2, help="ridge penalty of the linear fit's W")
    parser.add_argument("--linear-rounds", type=int, default=3,
                        help="fits of the linear maps: each after the first refits every layer on the trajectory "
                             "with the previous fit's maps applied (its inputs as deployed)")
    parser.add_argument("--shapes", nargs="+", default=list(PROBED),
                        help="probe only these shapes, replacing their rows in an existing --json")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    model = load_trained(cfg, cfg.checkpointer.checkpoint_dir)  # the stock pretrained folder
    tokenizer = config.instantiate(cfg.tokenizer)
    train = heldout_windows(tokenizer, args.train_text, args.seq_len, args.windows)
    held = heldout_windows(tokenizer, args.text, args.seq_len, args.windows)
    rows = []
    for shape in (s for s in SHAPES if s.name in args.shapes):
        for selection in SELECTIONS if shape.routed else ("oracle",):
            sums = SkippedUpdateSums()
            shape_loss(model, train, shape, selection, args.batch_size, args.seed, skipped_sums=sums)
            none = shape_loss(model, held, shape, selection, args.batch_size, args.seed)["loss"]
            mean = shape_loss(model, held, shape, selection, args.batch_size, args.seed,
                              skip_updates=sums.means())["loss"]
            maps = sums.linear_maps(args.ridge)
            linear = shape_loss(model, held, shape, selection, args.batch_size, args.seed, skip_updates=maps)["loss"]
            for _ in range(args.linear_rounds - 1):
                refit = SkippedUpdateSums()
                shape_loss(model, train, shape, selection, args.batch_size, args.seed, skip_updates=maps,
                           skipped_sums=refit)
                maps = refit.linear_maps(args.ridge)
            refitted = shape_loss(model, held, shape, selection, args.batch_size, args.seed, skip_updates=maps)["loss"]
            rows.append({"shape": asdict(shape), "selection": selection if shape.routed else "all", "none": none,
                         "mean_update": mean, "linear": linear, "linear_refitted": refitted,
                         "mean_update_norm": {str(i): float(v.norm()) for i, v in sums.means().items()}})
            print(f"{shape.name:14s} {selection:7s} none {none:.3f} mean update {mean:.3f} linear {linear:.3f} "
                  f"refitted {refitted:.3f}", flush=True)
            write(args, rows)


def write(args, rows) -> None:
    """The probe's JSON (and markdown), rewritten after every row; with ``--shapes`` a subset of the shapes
    replaces its rows in the existing JSON of the same settings."""
    probe = {"config": args.config, "train_text": str(args.train_text), "text": str(args.text),
             "windows": args.windows, "seq_len": args.seq_len, "seed": args.seed, "ridge": args.ridge,
             "linear_rounds": args.linear_rounds, "rows": rows}
    if set(args.shapes) != set(PROBED) and args.json.exists():
        earlier = json.loads(args.json.read_text())
        if {k: v for k, v in earlier.items() if k != "rows"} != {k: v for k, v in probe.items() if k != "rows"}:
            raise SystemExit(f"{args.json} holds a probe with other settings: probe every shape, or another --json")
        new = {(r["shape"]["name"], r["selection"]): r for r in rows}
        probe["rows"] = [new.pop((r["shape"]["name"], r["selection"]), r) for r in earlier["rows"]] + list(new.values())
    args.json.write_text(json.dumps(probe, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(probe))


if __name__ == "__main__":
    main()
