"""Pictures of one fine-tuning run of ``routed_finetune``, from its metric logs and its checkpoint (PNG).

    python -m torchtune_dtf.evaluation.routing_plots --config quickstart_work/recommended_0_81_linear/torchtune_config.yaml \
        --heldout quickstart_work/corpus/validation.jsonl [--out DIR] [--checkpoint DIR] [key=value ...]

``--config`` is the run's config: best the ``torchtune_config.yaml`` that the recipe saved in its ``output_dir``,
which carries the overrides the run was trained with. ``key=value`` / ``~key`` overrides follow as for ``tune run``.
The metric logs are the DiskLogger or TensorBoardLogger files in ``metric_logger.log_dir``
(:func:`~torchtune_dtf.evaluation.metric_logs.read_metric_logs`); the checkpoint is the newest ``epoch_N``
folder of ``output_dir`` unless ``--checkpoint`` names one (an ``epoch_N`` folder, or a stock HF checkpoint: the base
model with its routers as training initialises them). Written to ``--out`` (default ``<output_dir>/plots``):

* ``curves.png``: training LM loss, validation LM loss of the student (deployed) and of the teacher, and the
  auxiliary losses over training;
* ``executed_fraction.png``: per routed layer, the share of held-out tokens (``--windows`` × ``--seq-len``) the
  checkpoint's student and teacher run (configured capacity γ dashed), and both over training;
* ``token_heatmap.png``: which tokens of a held-out passage (``--passage-tokens`` tokens from ``--passage-start``,
  decoded along the x axis) each routed layer ran, in student mode: what is deployed;
* ``surprise.png``: SDT/STT only (other variants get a note saying why): the shares of the teacher's choices whose
  CE and whose CU criterion fired, and the learned offsets o_ce and m_cu, per layer over training;
* ``agreement.png``: teacher–student agreement (accuracy, precision, recall) per layer over training.

Every file is written for every variant (a figure that has nothing to show says why), and the list is printed.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from omegaconf import DictConfig
from torchtune import config

from torchtune_dtf.modules import (
    DroppedLayer,
    MoDLayer,
    RandomRoutedLayer,
    RoutedSelfAttentionLayer,
    RoutingContext,
    SDTDynamicLayer,
    STTLayer,
)
from torchtune_dtf.training.checkpointer import checkpoint_folders
from torchtune_dtf.evaluation.metric_logs import metric_series, read_metric_logs
from torchtune_dtf.evaluation.routing_report import (
    command_line_overrides,
    heldout_windows,
    layer_report,
    load_config,
    load_trained,
)

PLOTS = ("curves.png", "executed_fraction.png", "token_heatmap.png", "surprise.png", "agreement.png")
#: Names of the routed layer classes in figure titles and notes.
ROUTING_NAMES = ((STTLayer, "STT"), (SDTDynamicLayer, "SDT"), (MoDLayer, "MoD"), (RandomRoutedLayer, "random routing"))
#: Byte-level BPE tokens carry their whitespace; made visible so "␣the" and "the" differ on the axis.
VISIBLE_WHITESPACE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


@dataclass
class HeatMap:
    """Which tokens each routed layer ran on one passage in student mode.

    Attributes:
        layers: routed layer indices, one row each.
        executed: ``[len(layers), len(tokens)]`` bool, the layer's ``selected_mask`` of that forward.
        tokens: the passage's token ids.
        labels: each token decoded on its own, whitespace made visible.
    """

    layers: List[int]
    executed: torch.Tensor
    tokens: List[int]
    labels: List[str]


def token_label(tokenizer, token_id: int) -> str:
    """One token as text (special tokens by name), with its whitespace made visible."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    for char, shown in VISIBLE_WHITESPACE.items():
        text = text.replace(char, shown)
    return text


@torch.no_grad()
def student_heatmap(model: torch.nn.Module, tokenizer, tokens: torch.Tensor) -> HeatMap:
    """One student-mode forward (the deployed routing, as ``generate`` and ``eleuther_eval`` run it) on the 1-D
    ``tokens``, and the tokens each routed layer ran on."""
    routing = RoutingContext(mode="student")
    model(tokens[None], routing=routing)
    layers = sorted(routing.layers)
    executed = (torch.stack([routing.layers[i].selected_mask[0] for i in layers]) if layers
                else torch.zeros(0, tokens.numel(), dtype=torch.bool))
    ids = tokens.tolist()
    labels = [token_label(tokenizer, t) for t in ids]
    return HeatMap(layers=layers, executed=executed.bool().cpu(), tokens=ids, labels=labels)


def describe_routing(model: torch.nn.Module) -> Dict[str, Any]:
    """The model's routed layers by index, the name of its routing, and whether it routes by surprise (SDT/STT:
    the only variants with CE/CU criteria and the o_ce/m_cu offsets)."""
    routed = {m.layer_idx: m for m in model.modules() if isinstance(m, RoutedSelfAttentionLayer)}
    name = next((label for cls, label in ROUTING_NAMES if any(isinstance(m, cls) for m in routed.values())), None)
    if name is None:
        name = "layer dropping" if any(isinstance(m, DroppedLayer) for m in model.modules()) else "dense"
    surprise = any(isinstance(m, (STTLayer, SDTDynamicLayer)) for m in routed.values())
    return {"layers": dict(sorted(routed.items())), "name": name, "surprise": surprise}


def latest_checkpoint(output_dir: Path) -> Path:
    folders = checkpoint_folders(output_dir)
    if not folders:
        raise ValueError(f"{output_dir} holds no epoch_N checkpoint: name one (or a base HF checkpoint) with --checkpoint")
    return folders[max(folders)]


# ---------------------------------------------------------------------------------------------- drawing
def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("routing_plots draws with matplotlib: pip install -e '.[experiments]'") from err
    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _note(ax, text: str) -> None:
    """A figure with nothing to show says why, so every file exists and none is misread as an empty result."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig, path: Path, written: List[Path]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    written.append(path)


def _steps_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also on a 4-step run


def _layer_colors(layers: Sequence[int]) -> Dict[int, Any]:
    cmap = _pyplot().get_cmap("viridis")
    return {layer: cmap(i / max(1, len(layers) - 1)) for i, layer in enumerate(layers)}


def _per_layer(ax, rows, layers: Sequence[int], metric: str, ylabel: str) -> None:
    """``routing/layer_i/<metric>`` over training, one line per routed layer (colour: depth)."""
    colors = _layer_colors(layers)
    for layer in layers:
        steps, values = metric_series(rows, f"routing/layer_{layer}/{metric}")
        if steps:
            ax.plot(steps, values, color=colors[layer], linewidth=1.2, label=f"layer {layer}")
    _steps_axis(ax)
    ax.set_ylabel(ylabel)
    if not ax.lines:
        _note(ax, f"routing/layer_i/{metric} is not in the metric logs")
    else:
        ax.legend(fontsize=6, ncol=2 if len(layers) > 8 else 1)


def plot_curves(rows, routing: Dict[str, Any], path: Path, written: List[Path]) -> None:
    """Training LM loss, validation loss of student and teacher, and the auxiliary losses."""
    fig, (lm, aux) = _pyplot().subplots(1, 2, figsize=(11, 4))
    routed = bool(routing["layers"])
    steps, values = metric_series(rows, "loss/lm")
    if steps:
        lm.plot(steps, values, color="tab:gray", linewidth=1, label="training (routed pass)" if routed else "training")
    steps, values = metric_series(rows, "val/lm_loss_student")
    if steps:
        lm.plot(steps, values, "o-", color="tab:blue", label="validation, student (deployed)" if routed else "validation")
    steps, values = metric_series(rows, "val/lm_loss_teacher")
    if steps and routed:  # a dense model has no teacher: its two validation losses are the same forward
        lm.plot(steps, values, "s--", color="tab:orange", label="validation, teacher")
    _steps_axis(lm)
    lm.set_ylabel("LM loss per token")
    lm.set_title("Training and validation loss")
    if lm.lines:
        lm.legend(fontsize=8)
    else:
        _note(lm, "no loss/lm or val/* in the metric logs")
    for key, label in (("loss/pred", "L_pred (PriorFFN/TPN MSE)"), ("loss/causal", "L_causal (student BCE)"),
                       ("loss/g_reg", "L_g_reg (mean gate g)"), ("loss/distill", "L_distill (KL to dense)")):
        steps, values = metric_series(rows, key)
        # A loss that is identically 0 (MoD has no predictor) has no place on a log axis.
        if steps and any(v > 0 for v in values):
            aux.plot(steps, values, linewidth=1.2, label=label)
    _steps_axis(aux)
    aux.set_ylabel("auxiliary loss (unweighted)")
    aux.set_title("Auxiliary losses")
    if aux.lines:
        aux.set_yscale("log")
        aux.legend(fontsize=8)
    else:
        _note(aux, f"no auxiliary loss logged ({routing['name']} model)")
    _save(fig, path, written)


def plot_executed_fraction(rows, routing: Dict[str, Any], heldout: Dict[int, Dict[str, float]], heldout_tokens: int,
                           path: Path, written: List[Path]) -> None:
    """Per routed layer on held-out text (checkpoint): student vs teacher; and both over training (logs)."""
    plt = _pyplot()
    fig, (per_layer, training) = plt.subplots(1, 2, figsize=(11, 4))
    layers = list(routing["layers"])
    if not layers:
        for ax in (per_layer, training):
            _note(ax, f"no routed layers: this {routing['name']} model runs every kept layer on every token")
        _save(fig, path, written)
        return
    x = list(range(len(layers)))
    student = [heldout[i].get("student/selected_fraction", float("nan")) for i in layers]
    teacher = [heldout[i].get("teacher/teacher_fraction", float("nan")) for i in layers]
    per_layer.bar([v - 0.2 for v in x], student, width=0.4, color="tab:blue", label="student (deployed)")
    per_layer.bar([v + 0.2 for v in x], teacher, width=0.4, color="tab:orange",
                  label="teacher (final β)" if routing["surprise"] else "teacher")
    capacities = [getattr(routing["layers"][i], "capacity", None) for i in layers]
    if all(c is not None for c in capacities):
        per_layer.plot([v - 0.45 for v in x] + [x[-1] + 0.45], capacities + capacities[-1:], "k--", linewidth=1,
                       drawstyle="steps-post", label="capacity γ")
    per_layer.set_xticks(x, [str(i) for i in layers])
    per_layer.set_xlabel("routed layer")
    per_layer.set_ylabel("executed fraction")
    per_layer.set_ylim(0, 1.05)
    per_layer.set_title(f"Held-out text ({heldout_tokens} tokens), final checkpoint")
    per_layer.legend(fontsize=8)

    # Over training: the mean over routed layers, and the band from the least to the most executing layer.
    for metric, color, label in (("student_fraction", "tab:blue", "student"), ("teacher_fraction", "tab:orange", "teacher")):
        per_step: Dict[int, List[float]] = {}
        for layer in layers:
            for step, value in zip(*metric_series(rows, f"routing/layer_{layer}/{metric}")):
                per_step.setdefault(step, []).append(value)
        if per_step:
            steps = sorted(per_step)
            training.plot(steps, [sum(per_step[s]) / len(per_step[s]) for s in steps], color=color, label=f"{label}, mean")
            training.fill_between(steps, [min(per_step[s]) for s in steps], [max(per_step[s]) for s in steps],
                                  color=color, alpha=0.2, label=f"{label}, min–max over layers")
    _steps_axis(training)
    training.set_ylabel("executed fraction (training batches)")
    training.set_ylim(0, 1.05)
    training.set_title("Over training")
    if training.lines:
        training.legend(fontsize=8)
    else:
        _note(training, "no routing/layer_i/student_fraction in the metric logs")
    _save(fig, path, written)


def plot_heatmap(heat: HeatMap, routing: Dict[str, Any], path: Path, written: List[Path]) -> None:
    """Routed layers × tokens: dark where the layer ran its block on the token (student mode)."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    width = min(30.0, max(6.0, 0.17 * len(heat.tokens) + 2.5))
    if not heat.layers:
        fig, ax = plt.subplots(figsize=(width, 2.5))
        _note(ax, f"no routed layers: this {routing['name']} model runs every kept layer on every token")
        _save(fig, path, written)
        return
    fig, ax = plt.subplots(figsize=(width, 1.6 + 0.3 * len(heat.layers)))
    colors = ListedColormap(["#e8e8e8", "#1f5fa8"])
    ax.imshow(heat.executed.int().numpy(), cmap=colors, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    # "$" would start matplotlib's mathtext; the label is shown literally.
    ax.set_xticks(range(len(heat.tokens)), [label.replace("$", r"\$") for label in heat.labels], rotation=90, fontsize=7)
    fractions = heat.executed.float().mean(dim=1).tolist()
    ax.set_yticks(range(len(heat.layers)), [f"layer {i} ({f:.0%})" for i, f in zip(heat.layers, fractions)], fontsize=8)
    # Thin white lines between cells, so neighbouring tokens stay apart.
    ax.set_xticks([v - 0.5 for v in range(1, len(heat.tokens))], minor=True)
    ax.set_yticks([v - 0.5 for v in range(1, len(heat.layers))], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("held-out passage, one token per column (␣ space, ↵ newline)")
    ax.set_ylabel("routed layer (share run)")
    ax.set_title(f"{routing['name']}: which tokens each routed layer ran (student routing, as deployed)")
    ax.legend(handles=[Patch(color="#1f5fa8", label="ran the block"), Patch(color="#e8e8e8", label="skipped")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    _save(fig, path, written)


def plot_surprise(rows, routing: Dict[str, Any], path: Path, written: List[Path]) -> None:
    """SDT/STT: CE vs CU share of the teacher's choices, and o_ce / m_cu, per layer over training."""
    plt = _pyplot()
    if not routing["surprise"]:
        fig, ax = plt.subplots(figsize=(8, 3))
        why = ("routes by a learned router score" if routing["layers"] else "has no routed layers")
        _note(ax, f"CE/CU criteria and the offsets o_ce, m_cu belong to the surprise routing of SDT and STT.\n"
                  f"This {routing['name']} model {why}: nothing of this kind to plot.")
        ax.set_title("CE vs CU share, o_ce and m_cu")
        _save(fig, path, written)
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    layers = list(routing["layers"])
    for ax, metric, ylabel, title in (
        (axes[0, 0], "teacher_ce_share", "share of the teacher's choices", "CE fired (expected-event criterion)"),
        (axes[0, 1], "teacher_cu_share", "share of the teacher's choices", "CU fired (unexpected-event criterion)"),
        (axes[1, 0], "o_ce", "o_ce", "Learned CE offset o_ce"),
        (axes[1, 1], "m_cu", "m_cu", "Learned CU multiplier m_cu"),
    ):
        _per_layer(ax, rows, layers, metric, ylabel)
        ax.set_title(title, fontsize=10)
    for ax in axes[0]:
        ax.set_ylim(-0.02, 1.02)
    fig.suptitle(f"{routing['name']}: which surprise criterion selects tokens, over training")
    _save(fig, path, written)


def plot_agreement(rows, routing: Dict[str, Any], path: Path, written: List[Path]) -> None:
    """How well the causal student reproduces the teacher's selection, per layer over training."""
    plt = _pyplot()
    layers = list(routing["layers"])
    if not layers:
        fig, ax = plt.subplots(figsize=(8, 3))
        _note(ax, f"no routed layers: this {routing['name']} model has no teacher or student routing")
        ax.set_title("Teacher–student agreement")
        _save(fig, path, written)
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for ax, metric, title in ((axes[0], "agreement_accuracy", "accuracy (same decision)"),
                              (axes[1], "agreement_precision", "precision (student's picks the teacher made)"),
                              (axes[2], "agreement_recall", "recall (teacher's picks the student made)")):
        _per_layer(ax, rows, layers, metric, "agreement")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(-0.02, 1.02)
    fig.suptitle(f"{routing['name']}: teacher–student agreement per routed layer (training batches)")
    _save(fig, path, written)


# ---------------------------------------------------------------------------------------------- command
def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_dtf.evaluation.routing_plots", description=__doc__.split("\n\n")[0],
        epilog="Other key=value (~key) arguments override the config as tune run does.",
    )
    parser.add_argument("--config", type=Path, required=True,
                        help="the run's config (best <output_dir>/torchtune_config.yaml, saved by the recipe)")
    parser.add_argument("--heldout", type=Path, required=True, help="JSONL with a 'text' field: held-out text")
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default <output_dir>/plots)")
    parser.add_argument("--checkpoint", type=Path,
                        help="epoch_N folder or stock HF checkpoint (default: the newest epoch_N of output_dir)")
    parser.add_argument("--windows", type=int, default=4, help="held-out windows for the executed fractions")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per held-out window")
    parser.add_argument("--passage-tokens", type=int, default=64, help="tokens of the heat map's passage")
    parser.add_argument("--passage-start", type=int, default=0,
                        help="where the passage starts, in tokens of the held-out text (it runs as a sequence of its own)")
    parser.add_argument("--batch-size", type=int, default=4)
    args, overrides = command_line_overrides(parser, argv)

    cfg = load_config(args.config, overrides)
    output_dir = Path(cfg.output_dir)
    rows = read_metric_logs(cfg.get("metric_logger"))  # none yet for a base checkpoint: its curves say so
    log_dir = Path(str(cfg.metric_logger.log_dir))
    checkpoint = args.checkpoint or latest_checkpoint(output_dir)
    out = args.out or output_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = config.instantiate(cfg.tokenizer)
    model = load_trained(cfg, checkpoint)
    routing = describe_routing(model)
    start, length = args.passage_start, args.passage_tokens
    heat = student_heatmap(model, tokenizer, heldout_windows(tokenizer, args.heldout, start + length, 1)[0][start:])
    heldout: Dict[int, Dict[str, float]] = {}
    windows = heldout_windows(tokenizer, args.heldout, args.seq_len, args.windows)
    if routing["layers"]:
        beta = cfg.get("beta_schedule")  # the teacher at the schedule's final β, as validation ends
        heldout = layer_report(model, windows, beta.beta_ce_end if beta else None, beta.beta_cu_end if beta else None,
                               args.batch_size)

    written: List[Path] = []
    plot_curves(rows, routing, out / "curves.png", written)
    plot_executed_fraction(rows, routing, heldout, windows.numel(), out / "executed_fraction.png", written)
    plot_heatmap(heat, routing, out / "token_heatmap.png", written)
    plot_surprise(rows, routing, out / "surprise.png", written)
    plot_agreement(rows, routing, out / "agreement.png", written)
    print(f"Plots of {routing['name']} checkpoint {checkpoint} (metrics: {log_dir}{'' if rows else ', none logged'}):")
    for path in written:
        print(f"  {path}")
    return {"files": written, "routing": routing["name"], "heatmap": heat, "heldout_layers": heldout,
            "checkpoint": checkpoint, "log_dir": log_dir}


if __name__ == "__main__":
    main()
