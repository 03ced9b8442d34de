"""The study page's figures (matplotlib, written as PNG beside the page): the quality–compute frontier, training
curves, validation student vs teacher, executed fraction per routed layer, and the papers' claims."""

import math
import statistics
from pathlib import Path
from typing import Collection, Dict, List, Optional, Tuple

from experiments.results import (METRIC, ROUTED_VARIANTS, Results, layer_mean_curve, layer_values, mean_curve,
                                 model_config)
from experiments.stats import lowest_at_equal_flops, mean_std

#: The figures ``make_plots`` writes, and their headings on the study page.
TITLES = {"frontier.png": "Frontier: student held-out loss vs forward FLOPs ratio (dense: dashed line)",
          "curves.png": "Training LM loss (mean over seeds)",
          "validation.png": "Validation loss, student vs teacher",
          "executed_fraction.png": "Executed fraction per routed layer (student, held-out windows)"}
FAMILY_COLORS = {"dense": "black", "layerdrop": "tab:orange", "random": "tab:gray", "mod": "tab:purple",
                 "sdt": "tab:green", "stt": "tab:blue"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    return matplotlib, plt


def make_plots(out_dir: Path, order: List[str], runs: Results, dense_names: List[str]) -> List[str]:
    """Write the four study figures (``TITLES``) into ``out_dir``; return their file names."""
    matplotlib, plt = _pyplot()
    names = [n for n in order if runs.get(n)]
    # Ten colours, then the next ten runs with another marker and line style: every run keeps its own look
    # however many a study has.
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    markers = {n: "os^Dv*"[(i // 10) % 6] for i, n in enumerate(names)}
    lines = {n: ("-", "--", ":", "-.")[(i // 10) % 4] for i, n in enumerate(names)}
    written = []

    def finish(fig, ax, name, empty_note, integer_x=True):
        if integer_x:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        fig.tight_layout()
        if not ax.has_data():
            ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes)
        elif ax.get_legend_handles_labels()[0]:
            # Placed after the layout, one column per 24 entries, the saved canvas grown to hold it (bbox_inches):
            # the axes keep their size, and a study of many runs loses no name off the figure's edge.
            entries = len(ax.get_legend_handles_labels()[0])
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                      ncol=math.ceil(entries / 24))
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    # (a) frontier: student held-out loss against forward FLOPs ratio. Coloured by family (dense, layer dropping,
    # random, MoD, SDT, STT) and named on the plot: a study has more runs than a legend can tell apart. The two
    # static baselines are joined across FLOP levels and to dense (their point at 1.0), so a routed run below
    # their line beats them at its compute (the comparison experiments/frontier/targets.py makes).
    marks = []  # (name, family, x mean, x std, y mean, y std)
    for n in names:
        xm, xs = mean_std([METRIC["fwd FLOPs ratio"](r) for r in runs[n]])
        ym, ys = mean_std([METRIC["student loss"](r) for r in runs[n]])
        if xm is not None and ym is not None:
            marks.append((n, str(runs[n][0].get("variant", "?")), xm, xs, ym, ys))
    dense_losses = [(n, mean_std([r["heldout"]["student_loss"] for r in runs.get(n, [])])[0]) for n in dense_names]
    # A study of many recipes puts dozens at one FLOP level, so only each family's Pareto front is named (no run
    # of the same family at fewer or equal FLOPs with a lower or equal loss): the runs a reader compares. Every
    # point is still drawn, and the tables name them all.
    named = {n for n, family, xm, _, ym, _ in marks
             if not any(f == family and o != n and x <= xm and y <= ym for o, f, x, _, y, _ in marks)}
    # Named points close in FLOPs take turns above and below their marker, so two fronts crossing stay legible.
    label_offset = {n: (4, 3 if i % 2 == 0 else -9)
                    for i, n in enumerate(sorted(named, key=lambda n: next(m[2] for m in marks if m[0] == n)))}
    # Left: every run. Right: the band between dense and the layer-dropping line, where the comparisons are.
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    for ax in axes:
        seen = set()
        for n, family, xm, xs, ym, ys in marks:
            color = FAMILY_COLORS.get(family, "tab:brown")
            ax.errorbar([xm], [ym], xerr=[xs], yerr=[ys], fmt="o", markersize=4, capsize=2, color=color,
                        label=None if family in seen else family)
            if n in named:
                ax.annotate(f"{n} ({len(runs[n])})", (xm, ym), textcoords="offset points", xytext=label_offset[n],
                            fontsize=6, color=color)
            seen.add(family)
        for family in ("layerdrop", "random"):
            # At equal FLOPs (layer dropping with and without distillation) the line takes the lower loss: the
            # stronger baseline, as targets.py does per seed.
            xy = lowest_at_equal_flops([(xm, ym) for _, f, xm, _, ym, _ in marks if f in (family, "dense")], digits=3)
            if any(f == family for _, f, *_ in marks) and len(xy) > 1:
                ax.plot([x for x, _ in xy], [y for _, y in xy], "-", color=FAMILY_COLORS[family], linewidth=1,
                        alpha=0.6)
        for n, ym in dense_losses:
            if ym is not None:
                ax.axhline(ym, color="gray", linestyle="--", linewidth=1, label=f"{n} (reference)")
        ax.set_xlabel("forward FLOPs per token ÷ dense (closed form)")
        ax.set_ylabel("held-out loss per token (student)")
    axes[0].set_title("Quality–compute frontier (mean ± std over seeds; (n) = seeds;\nnamed: each family's "
                      "Pareto front)")
    drop_losses = [ym for _, f, _, _, ym, _ in marks if f == "layerdrop"]
    floor = min([ym for _, ym in dense_losses if ym is not None] + [ym for *_, ym, _ in marks], default=None)
    if drop_losses and floor is not None:
        axes[1].set_ylim(floor - 0.05, max(drop_losses) + 0.15)
        axes[1].set_title("zoom: dense to the layer-dropping line")
    else:
        axes[1].set_title("zoom (no layer-dropping run yet)")
    # the legend right of the last panel, where the canvas grows to hold it
    finish(fig, axes[-1], "frontier.png", "no run with held-out loss and FLOPs yet", integer_x=False)

    # (b) training curves
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for n in names:
        steps, values = mean_curve(runs[n], "loss/lm")
        if steps:
            ax.plot(steps, values, lines[n], color=colors[n], label=n)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training LM loss (mean over seeds)")
    ax.set_title("Training curves")
    finish(fig, ax, "curves.png", "no training curve yet")

    # (c) validation: student vs teacher
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for n in names:
        for key, style, label in (("val/lm_loss_student", "-", "student"), ("val/lm_loss_teacher", "--", "teacher")):
            steps, values = mean_curve(runs[n], key)
            if steps and not (label == "teacher" and all(r.get("variant") == "dense" for r in runs[n])):
                ax.plot(steps, values, style, marker=markers[n], markersize=3, color=colors[n], label=f"{n} {label}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation LM loss (mean over seeds)")
    ax.set_title("Validation: student (solid) vs teacher (dashed)")
    finish(fig, ax, "validation.png", "no validation point yet")

    # (d) executed fraction per layer (student, held-out windows)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for n in names:
        layers = sorted({int(k) for r in runs[n] for k in (r.get("executed_fraction") or {})})
        if not layers:
            continue
        means = [statistics.fmean([r["executed_fraction"][str(l)] for r in runs[n] if str(l) in r["executed_fraction"]])
                 for l in layers]
        ax.plot(layers, means, lines[n], marker=markers[n], color=colors[n], label=n)
    ax.set_xlabel("layer")
    ax.set_ylabel("executed fraction (student, held-out)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Executed fraction per routed layer")
    finish(fig, ax, "executed_fraction.png", "no routed run yet")
    return written


#: The validation series the gap curves are drawn from (student: what is deployed).
GAP_KEY = "val/lm_loss_student"
#: Per baseline, per run: (steps, run − baseline, seeds averaged).
GapCurves = Dict[str, Dict[str, Tuple[List[int], List[float], List[int]]]]


def gaps_plot(out_dir: Path, curves: GapCurves, in_training: Collection[str] = ()) -> None:
    """``gaps.png``: one panel per baseline of ``curves`` (``{baseline: {row: (steps, differences, seeds)}}``, as
    :func:`paired_curve_difference` gives them), each row's validation loss (student) minus the baseline's at the
    same step, paired by seed: how a gap moves as training goes on. Rows named in ``in_training`` (runs still
    training) are drawn dashed with open markers."""
    matplotlib, plt = _pyplot()
    rows = list(dict.fromkeys(row for by_row in curves.values() for row in by_row))
    colors = {row: plt.cm.tab10(i % 10) for i, row in enumerate(rows)}
    styles = {row: ("-", "--", ":", "-.")[(i // 10) % 4] for i, row in enumerate(rows)}
    fig, axes = plt.subplots(1, len(curves), figsize=(6.2 * len(curves), 4.6), squeeze=False)
    for ax, (base, by_row) in zip(axes[0], curves.items()):
        for row, (steps, diffs, _) in by_row.items():
            running = row in in_training
            ax.plot(steps, diffs, "--" if running else styles[row], marker="o", markersize=4 if running else 3,
                    markerfacecolor="white" if running else colors[row], color=colors[row], label=row)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"validation loss − {base} (student, paired by seed)")
        ax.set_title(f"against {base}", fontsize=9)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.tight_layout()
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.95))
    fig.savefig(out_dir / "gaps.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def surprise_runs(names: List[str], runs: Results) -> List[str]:
    """The SDT/STT runs among ``names``: those the claims concern."""
    return [n for n in names if runs[n][0].get("variant") in ("sdt", "stt")]


def dynamic_runs(names: List[str], runs: Results) -> List[str]:
    """The SDT/STT runs with a threshold (dynamic-capacity) teacher."""
    return [n for n in surprise_runs(names, runs) if model_config(runs[n][0]).get("teacher_selection") == "threshold"]


def claims_plot(out_dir: Path, names: List[str], runs: Results, plotted: Optional[List[str]] = None) -> str:
    """``claims.png``, five panels for the papers' qualitative claims: training LM loss of the routed runs (Fig.
    2A); the share of the update the PriorFFN (SDT) or TPN (STT) leaves unexplained over training (Fig. 2B); STT
    dynamic capacity per layer (Fig. 2C); the shares of the teacher's choices whose CE and CU criterion fired;
    teacher–student agreement per layer. Draws the runs in ``plotted`` (the study's ``claims_runs``), or all of
    them when it is ``None`` (twenty runs make four unreadable legends)."""
    _, plt = _pyplot()
    drawn = set(names if plotted is None else plotted)
    surprise, dynamic = surprise_runs(names, runs), dynamic_runs(names, runs)
    fig, grid = plt.subplots(3, 2, figsize=(11, 12))
    axes = {"2A": grid[0, 0], "2B": grid[0, 1], "2C": grid[1, 0], "shares": grid[1, 1], "agreement": grid[2, 0]}
    grid[2, 1].axis("off")
    # Fig. 2A: the training LM loss of the routed runs (MoD too), as the paper compares them
    for n in names:
        if runs[n][0].get("variant") in ROUTED_VARIANTS and n in drawn:
            steps, lm = mean_curve(runs[n], "loss/lm")
            if steps:
                axes["2A"].plot(steps, lm, "-" if runs[n][0]["variant"] == "stt" else "--" if runs[n][0]["variant"]
                                == "sdt" else ":", label=f"{n} ({len(runs[n])} seeds)")
    for n in surprise:
        if n not in drawn:
            continue
        rs = runs[n]
        share_steps, share = layer_mean_curve(rs, "d_ch", divided_by="d_st")
        ce_steps, ce = layer_mean_curve(rs, "teacher_ce_share")
        _, cu = layer_mean_curve(rs, "teacher_cu_share")
        agreement = layer_values(rs, "teacher/agreement_accuracy")
        style = "-" if rs[0]["variant"] == "stt" else "--"
        if share_steps:
            axes["2B"].plot(share_steps, share, style, label=f"{n} ({'TPN' if rs[0]['variant'] == 'stt' else 'PriorFFN'})")
        if ce_steps:
            (ce_line,) = axes["shares"].plot(ce_steps, ce, style, label=f"{n} CE")
            axes["shares"].plot(ce_steps, cu, ":", color=ce_line.get_color(), label=f"{n} CU")
        if agreement:
            axes["agreement"].plot(list(agreement), list(agreement.values()), style, marker="o", label=n)
    for n in dynamic:
        fractions = layer_values(runs[n], "teacher/teacher_fraction")
        if fractions and n in drawn:
            axes["2C"].plot(list(fractions), list(fractions.values()), marker="o", label=f"{n} teacher")
            student = layer_values(runs[n], "student/selected_fraction")
            axes["2C"].plot(list(student), list(student.values()), "--", marker=".", label=f"{n} student")
    for ax, title, xlabel, ylabel in (
        (axes["2A"], "Fig. 2A: training LM loss (mean over seeds; STT solid, SDT dashed, MoD dotted)",
         "optimizer step", "LM loss"),
        # Not the raw L_pred the paper plots: one layer's massive update decides that mean (unexplained_update_share)
        (axes["2B"], "Fig. 2B: share of the update the predictor leaves unexplained\n(PriorFFN dashed, TPN solid)",
         "optimizer step", "D_ch / D_st, mean over routed layers"),
        (axes["2C"], "Fig. 2C: STT dynamic capacity per layer", "layer", "executed fraction"),
        (axes["shares"], "Share of the teacher's choices whose CE / CU fired (CU dotted)", "optimizer step", "share"),
        (axes["agreement"], "Teacher–student agreement per layer (STT solid, SDT dashed)", "layer", "accuracy"),
    ):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ax.has_data():
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no run of this kind yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out_dir / "claims.png", dpi=110)
    plt.close(fig)
    return "claims.png"
