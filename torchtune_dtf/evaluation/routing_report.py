"""Compare fine-tuned dense and routed checkpoints on held-out text.

    python -m torchtune_dtf.evaluation.routing_report \
        --dense configs/quickstart/dense_smollm2.yaml quickstart_work/dense/epoch_0 \
        --routed configs/quickstart/recommended_0_81_linear_smollm2.yaml quickstart_work/recommended_0_81_linear/epoch_0 \
        --heldout quickstart_work/corpus/validation.jsonl --windows 16 --seq-len 256 [key=value ...]

    # the quickstart's side-by-side: test windows spread over the test works, an interval, speed, continuations
    python -m torchtune_dtf.evaluation.routing_report --dense ... --routed ... \
        --heldout quickstart_work/corpus/test.jsonl --spread --windows 64 --seq-len 256 \
        --bootstrap 2000 --speed-rounds 5 --new-tokens 48 --prompt "Shall I compare thee to a summer's day?"

Config overrides follow the options as ``tune run`` takes them (``key=value``, ``~key``; torchtune's own merge) and
apply to the routed config, e.g. ``model.student_threshold=0.3``; prefixed with ``dense.`` they apply to the dense
config instead (``dense.tokenizer.max_seq_len=512``). A CHECKPOINT_DIR is an ``epoch_N`` folder the recipe saved or
a stock HF checkpoint folder (the base model before fine-tuning; a routed config then starts its routers from the
checkpointer's ``routing_init_seed``, as training does).

For each model it reports the held-out LM loss (per token, on the same fixed windows of the concatenated
held-out documents). For the routed model it reports the loss of the student (causal routing, what is
deployed) and of the teacher at the final β of the training schedule, each routed layer's executed
fraction under the student, the teacher–student agreement (accuracy, precision, recall) of the
causal router against the teacher's selection, and two checks that the teacher's ranking carries the
surprise signal rather than position order (docs/design.md R1): the share of tokens whose ranking score ties with
another's, and the share of teacher-selected tokens in the first half of each window (≈ 0.5 unbiased,
≈ 1.0 when ties degenerate to "the first half of the window").

Options add what a user compares (:mod:`torchtune_dtf.evaluation.side_by_side`): ``--spread`` spaces the windows
over the whole file instead of taking its first ones; ``--bootstrap N`` adds a 95 % interval of the student − dense
loss difference over windows (paired, N resamples); ``--speed-rounds R`` times prefill (``b1 × seq_len``) and
greedy ``generate`` (``--new-tokens``) of both models, interleaved, and prints tokens/s beside the closed-form FLOP
ratio; each ``--prompt`` is continued greedily by both models and printed with its newline share and distinct-2;
``--eleuther DENSE_JSON ROUTED_JSON`` adds the accuracies of two ``routed_eval_results.json`` files.
"""

import argparse
import json
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, training
from torchtune.config._utils import _merge_yaml_and_cli_args

from torchtune_dtf import closed_form
from torchtune_dtf.evaluation import side_by_side
from torchtune_dtf.models.model_config import merged_model_config
from torchtune_dtf.models.routing_config import with_keys_added_later
from torchtune_dtf.modules.routing_context import RoutingContext
from torchtune_dtf.training.checkpointer import hf_weight_files
from torchtune_dtf.training.routing_losses import routing_metrics

#: Overrides with this prefix go to the dense config of ``main``; the others to the routed config.
DENSE_PREFIX = "dense."


def load_config(path: Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The YAML config at ``path`` with ``key=value`` / ``~key`` overrides applied exactly as ``tune run`` applies
    them (torchtune's own merge: ``model=builder`` sets ``model._component_``, ``None`` is null)."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return _merge_yaml_and_cli_args(argparse.Namespace(**raw), list(overrides))


def split_overrides(overrides: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(routed, dense) overrides: ``dense.key=value`` and ``~dense.key`` go to the dense config, without the prefix."""
    routed, dense = [], []
    for arg in overrides:
        removal = arg.startswith("~")
        body = arg[1:] if removal else arg
        if body.startswith(DENSE_PREFIX):
            dense.append(("~" if removal else "") + body[len(DENSE_PREFIX):])
        else:
            routed.append(arg)
    return routed, dense


def command_line_overrides(
    parser: argparse.ArgumentParser, argv: Optional[List[str]]
) -> Tuple[argparse.Namespace, List[str]]:
    """The parsed options and the ``key=value`` overrides among the arguments, as ``tune run`` separates them: every
    argument that is not an option is an override, and an unknown option is an error (not a silent override)."""
    args, rest = parser.parse_known_args(argv)
    unknown = [arg for arg in rest if arg.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides are key=value)")
    return args, rest


def heldout_windows(tokenizer, heldout_file: Path, seq_len: int, num_windows: int, *, spread: bool = False) -> torch.Tensor:
    """``[num_windows, seq_len]`` windows of the concatenated held-out documents (each encoded with EOS): the first
    ones, or with ``spread`` windows evenly spaced over the whole file (every work of a test file is read)."""
    needed = seq_len * num_windows
    ids: List[int] = []
    with open(heldout_file, encoding="utf-8") as f:
        for line in f:
            ids += tokenizer.encode(json.loads(line)["text"], add_bos=False, add_eos=True)
            if len(ids) >= needed and not spread:
                break
    if len(ids) < needed:
        raise ValueError(f"{heldout_file} holds {len(ids)} tokens, fewer than {num_windows} windows of {seq_len}")
    stride = len(ids) // num_windows if spread else seq_len
    return torch.stack([torch.tensor(ids[i * stride : i * stride + seq_len]) for i in range(num_windows)])


def load_trained(cfg: DictConfig, checkpoint_dir: Path) -> torch.nn.Module:
    """The config's model with the weights in ``checkpoint_dir``: an ``epoch_N`` folder the recipe saved, or a
    stock HF checkpoint folder (its weight files are found as the checkpointer finds them: shard index first).

    A stock folder is a base model that was never routed: the config's checkpointer then initialises the routing
    weights from its ``routing_init_seed`` (what training starts from). Loading writes nothing: the checkpointer's
    ``output_dir`` is a temporary folder, not one beside a checkpoint the user may not own.

    A LoRA run's config loads its checkpoint into the builder's non-LoRA twin (:func:`merged_model_config`): the
    recipe saves LoRA merged into the base weights. A config saved before a routing key became required loads
    with the value that computes what it trained (:func:`~torchtune_dtf.models.routing_config.with_keys_added_later`)."""
    checkpoint_dir = Path(checkpoint_dir)
    cfg = cfg.copy()
    OmegaConf.update(cfg, "model", trained_model_config(cfg), merge=False)
    ckpt_cfg = OmegaConf.merge(
        cfg.checkpointer, {"checkpoint_dir": str(checkpoint_dir), "checkpoint_files": hf_weight_files(checkpoint_dir)}
    )
    with tempfile.TemporaryDirectory() as out:
        ckpt_cfg.output_dir = out
        state = config.instantiate(ckpt_cfg).load_checkpoint()[training.MODEL_KEY]
    with training.set_default_dtype(torch.float32):
        model = config.instantiate(cfg.model)
    model.load_state_dict(state, strict=True)
    return model.eval()


def trained_model_config(cfg: DictConfig) -> dict:
    """The ``model`` section that a run's saved checkpoint loads into (:func:`load_trained`'s), resolved: a LoRA
    builder's non-LoRA twin, and keys added after the config was written at the value that computes what it
    trained."""
    return with_keys_added_later(merged_model_config(OmegaConf.to_container(cfg.model, resolve=True)))


def heldout_loss(model, windows: torch.Tensor, routing: Optional[RoutingContext], batch_size: int) -> float:
    """Mean next-token loss over every window (each window has the same number of targets)."""
    return float(_window_losses(model, windows, routing, batch_size).mean())


def _window_losses(model, windows: torch.Tensor, routing: Optional[RoutingContext], batch_size: int) -> torch.Tensor:
    fresh = None if routing is None else (
        lambda: RoutingContext(mode=routing.mode, beta_ce=routing.beta_ce, beta_cu=routing.beta_cu))
    return side_by_side.window_losses(model, windows, fresh, batch_size)


@torch.no_grad()
def routed_passes(model, windows: torch.Tensor, beta_ce: float, beta_cu: float,
                  batch_size: int) -> Tuple[Dict[int, Dict[str, float]], torch.Tensor, torch.Tensor]:
    """One student and one teacher (at ``beta_ce``/``beta_cu``) forward per batch of ``windows [n, seq_len]``:
    per routed layer the student's executed fraction, the teacher's and their agreement, averaged over batches, and
    the ``[n]`` student and teacher loss of each window from the same passes (what :func:`heldout_loss` gives with
    a pass of its own per mode)."""
    sums: Dict[str, float] = {}
    losses: Dict[str, List[torch.Tensor]] = {"student": [], "teacher": []}
    batches = 0
    for batch in windows.split(batch_size):
        student = RoutingContext(mode="student")
        losses["student"].append(side_by_side.next_token_losses(model(batch, routing=student), batch))
        teacher = RoutingContext(mode="teacher", beta_ce=beta_ce, beta_cu=beta_cu)
        losses["teacher"].append(side_by_side.next_token_losses(model(batch, routing=teacher), batch))
        for key, value in {**routing_metrics(student, "student"), **routing_metrics(teacher, "teacher")}.items():
            sums[key] = sums.get(key, 0.0) + value
        batches += 1
    layers: Dict[int, Dict[str, float]] = {}
    for key, value in sums.items():
        prefix, layer, name = key.split("/")
        layers.setdefault(int(layer.split("_")[1]), {})[f"{prefix}/{name}"] = value / batches
    return dict(sorted(layers.items())), torch.cat(losses["student"]), torch.cat(losses["teacher"])


def layer_report(model, windows: torch.Tensor, beta_ce: float, beta_cu: float, batch_size: int) -> Dict[int, Dict[str, float]]:
    """Per routed layer, averaged over batches: student executed fraction, teacher fraction, agreement."""
    return routed_passes(model, windows, beta_ce, beta_cu, batch_size)[0]


def main(argv: Optional[List[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_dtf.evaluation.routing_report", description=__doc__.split("\n\n")[0],
        epilog="Other key=value (~key) arguments override the routed config as tune run does; "
               "dense.key=value the dense one.",
    )
    parser.add_argument("--dense", nargs=2, metavar=("CONFIG", "CHECKPOINT_DIR"), required=True)
    parser.add_argument("--routed", nargs=2, metavar=("CONFIG", "CHECKPOINT_DIR"), required=True)
    parser.add_argument("--heldout", type=Path, required=True, help="JSONL with a 'text' field")
    parser.add_argument("--windows", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--spread", action="store_true", help="space the windows over the whole file")
    parser.add_argument("--diagnostic-windows", type=int, default=None, metavar="K",
                        help="teacher loss and the per-layer table over the first K windows only (default: all)")
    parser.add_argument("--bootstrap", type=int, default=0, metavar="N",
                        help="95%% interval of student - dense over windows, N paired resamples (0: off)")
    parser.add_argument("--speed-rounds", type=int, default=0, metavar="R", help="time prefill and generate (0: off)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt and per timed generate")
    parser.add_argument("--prompt", action="append", default=[], help="continue this prompt greedily (repeatable)")
    parser.add_argument("--eleuther", nargs=2, type=Path, metavar=("DENSE_JSON", "ROUTED_JSON"),
                        help="routed_eval_results.json of each model")
    parser.add_argument("--json", type=Path, help="also write the report here")
    # --meta takes every KEY=VALUE after it, config overrides included: give the overrides before it.
    parser.add_argument("--meta", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra fields for the JSON (takes every KEY=VALUE after it: put config overrides before)")
    args, overrides = command_line_overrides(parser, argv)

    routed_overrides, dense_overrides = split_overrides(overrides)
    dense_cfg, routed_cfg = load_config(args.dense[0], dense_overrides), load_config(args.routed[0], routed_overrides)
    tokenizer = config.instantiate(routed_cfg.tokenizer)
    windows = heldout_windows(tokenizer, args.heldout, args.seq_len, args.windows, spread=args.spread)
    dense = load_trained(dense_cfg, Path(args.dense[1]))
    routed = load_trained(routed_cfg, Path(args.routed[1]))
    beta = routed_cfg.beta_schedule
    final = RoutingContext(mode="teacher", beta_ce=beta.beta_ce_end, beta_cu=beta.beta_cu_end)
    report = {
        **dict(item.split("=", 1) for item in args.meta),
        "config": {"routing": {k: v for k, v in OmegaConf.to_container(routed_cfg.model).items() if k != "_component_"},
                   "scheduled_sampling": OmegaConf.to_container(routed_cfg.get("scheduled_sampling", {}))},
        "heldout": {"file": str(args.heldout), "windows": args.windows, "seq_len": args.seq_len,
                    "placement": "spread" if args.spread else "first"},
        "heldout_tokens": int(windows[:, 1:].numel()),
    }
    # The teacher and the per-layer diagnostics cost two more passes; --diagnostic-windows keeps them short.
    diagnostic = windows[: args.diagnostic_windows] if args.diagnostic_windows else windows
    report["diagnostic_windows"] = int(diagnostic.shape[0])
    per_window = {
        "dense": _window_losses(dense, windows, None, args.batch_size),
        "routed_student": _window_losses(routed, windows, RoutingContext(mode="student"), args.batch_size),
    }
    report["loss"] = {name: float(losses.mean()) for name, losses in per_window.items()}
    report["layers"], _, teacher_losses = routed_passes(routed, diagnostic, final.beta_ce, final.beta_cu, args.batch_size)
    report["loss"]["routed_teacher"] = float(teacher_losses.mean())
    if args.bootstrap:
        low, high = side_by_side.paired_bootstrap(
            per_window["routed_student"], per_window["dense"], resamples=args.bootstrap, seed=0)
        report["student_minus_dense"] = {"mean": report["loss"]["routed_student"] - report["loss"]["dense"],
                                         "interval_95": [low, high], "resamples": args.bootstrap, "paired_by": "window"}
    report["flop_ratio"] = closed_form.model_config_flop_ratio(
        OmegaConf.to_container(routed_cfg.model, resolve=True), args.seq_len)
    models = {"dense": dense, "routed": routed}
    if args.speed_rounds:
        prompt = windows[:1, :16]
        report["speed"] = {
            "prefill_tokens_per_s": side_by_side.prefill_tokens_per_s(models, windows[:1], args.speed_rounds),
            "generate_tokens_per_s": side_by_side.generate_tokens_per_s(models, prompt, args.new_tokens, args.speed_rounds),
            "measured": f"fp32, eager, {torch.get_num_threads()} threads, prefill b1 x {args.seq_len}, greedy generate "
                        f"of {args.new_tokens} tokens after 16, medians of {args.speed_rounds} interleaved rounds",
        }
    if args.prompt:
        report["continuations"] = {
            name: side_by_side.continuations(model, tokenizer, args.prompt, args.new_tokens) for name, model in models.items()}
    if args.eleuther:
        report["eleuther"] = {name: json.loads(path.read_text())["results"] for name, path in zip(models, args.eleuther)}

    loss = report["loss"]
    where = "spread over" if args.spread else "the first of"
    print(f"\nHeld-out LM loss per token ({report['heldout_tokens']} tokens, {args.windows} windows of {args.seq_len} "
          f"{where} {args.heldout}):")
    print(f"  dense          {loss['dense']:.4f}   (perplexity {torch.tensor(loss['dense']).exp():.1f})")
    print(f"  routed student {loss['routed_student']:.4f}   (perplexity {torch.tensor(loss['routed_student']).exp():.1f})  <- deployed")
    teacher_on = "" if report["diagnostic_windows"] == args.windows else f", first {report['diagnostic_windows']} windows"
    print(f"  routed teacher {loss['routed_teacher']:.4f}   (β_ce={final.beta_ce}, β_cu={final.beta_cu}{teacher_on})")
    if "student_minus_dense" in report:
        gap = report["student_minus_dense"]
        print(f"  student - dense {gap['mean']:+.4f}   (95 % interval over windows, paired bootstrap: "
              f"[{gap['interval_95'][0]:+.4f}, {gap['interval_95'][1]:+.4f}])")
    print(f"\nPer routed layer ({report['diagnostic_windows']} windows): executed fraction (student, teacher), "
          "teacher–student agreement, and the")
    print("teacher ranking's tied-score share and first-half share of its selection (0.5 = no position bias)")
    print("  layer  student  teacher  accuracy  precision  recall   ties  first_half")
    for idx, row in report["layers"].items():
        print(
            f"  {idx:5d}  {row['student/selected_fraction']:7.3f}  {row['teacher/teacher_fraction']:7.3f}"
            f"  {row['teacher/agreement_accuracy']:8.3f}  {row['teacher/agreement_precision']:9.3f}"
            f"  {row['teacher/agreement_recall']:6.3f}  {row['teacher/score_tie_share']:5.3f}"
            f"  {row['teacher/teacher_first_half_share']:10.3f}"
        )
    mean = lambda key: sum(r[key] for r in report["layers"].values()) / len(report["layers"])  # noqa: E731
    print(f"  mean   {mean('student/selected_fraction'):7.3f}  {mean('teacher/teacher_fraction'):7.3f}"
          f"  {mean('teacher/agreement_accuracy'):8.3f}  {mean('teacher/agreement_precision'):9.3f}"
          f"  {mean('teacher/agreement_recall'):6.3f}  {mean('teacher/score_tie_share'):5.3f}"
          f"  {mean('teacher/teacher_first_half_share'):10.3f}")
    _print_side_by_side(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


def _print_side_by_side(report: Dict) -> None:
    print(f"\nForward FLOPs, routed / dense (closed form, at the window length): {report['flop_ratio']:.3f}")
    if "speed" in report:
        speed = report["speed"]
        print(f"Measured speed ({speed['measured']}):")
        print("                  dense      routed   routed/dense")
        for key, label in (("prefill_tokens_per_s", "prefill tok/s"), ("generate_tokens_per_s", "generate tok/s")):
            dense, routed = speed[key]["dense"], speed[key]["routed"]
            print(f"  {label:14s} {dense:9.1f}  {routed:9.1f}   {routed / dense:6.2f}x")
    if "eleuther" in report:
        print("Stock eval (lm-eval through torchtune's eleuther_eval):")
        for name, results in report["eleuther"].items():
            for task, metrics in results.items():
                shown = ", ".join(f"{k.split(',')[0]} {v:.3f}" for k, v in metrics.items()
                                  if isinstance(v, float) and "stderr" not in k)
                print(f"  {name:7s} {task}: {shown}")
    for name, rows in report.get("continuations", {}).items():
        print(f"\nGreedy continuations, {name}:")
        for row in rows:
            print(f"  {row['prompt']!r} -> {row['text']!r}")
            print(f"      newline share {row['newline_share']:.2f}, distinct-2 {row['distinct_2']:.2f}")


if __name__ == "__main__":
    main()
