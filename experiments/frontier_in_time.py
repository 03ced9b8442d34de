"""The frontier in time: a study's student loss against *measured* routed/dense time, beside FLOPs (issue 48).

    python experiments/frontier_in_time.py --study experiments/budget_cpu200 \
        --timing benchmarks/results/frontier_time_smollm2/results.json
    python experiments/frontier_in_time.py --study experiments/attribution --loss test --mode compiled \
        --timing benchmarks/results/frontier_time_smollm2_compiled/results.json \
                 benchmarks/results/frontier_time_smollm2_compiled_prefill/results.json

The timing file is ``python -m benchmarks.compiled``'s (each model interleaved with dense in one process, time /
dense per workload); its labels name study runs through ``benchmarks.compiled.SMOLLM2_RECIPES``. Given several,
each workload is taken whole from the last file that times it (e.g. a prefill re-timed in a process of its own),
so every ratio of one workload still comes from one interleaved run. For each workload
(prefill, decode at batch 1) and for the study's own FLOPs (closed form at the executed fractions it measured, the
x axis of its frontier), the page draws student loss (mean over the seeds the
study has) against the cost, and gives each level's verdict: the recommended recipe's loss minus the
layer-dropping line's at the recipe's own cost, the line interpolated linearly between the timed layer-dropping
runs on either side (dense is its end at 1). Negative: the recipe is better than dropping layers at what it costs in that unit.

The loss is the study's student loss on its held-out validation windows (``--loss heldout``, what the budget study
reports) or on the test windows no choice read (``--loss test``, what the attribution study reports). Writes
``time_frontier.png`` and ``time_frontier.md`` into the study folder (``time_frontier_<mode>_<loss>.*`` for any
other mode or loss, so the pages of several timings sit side by side).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import paired_ratio  # noqa: E402
from benchmarks.compiled import BASELINE_OF, SMOLLM2_RECIPES  # noqa: E402
from experiments.results import METRIC, field, load_results  # noqa: E402

#: Costs on the x axis: (key in the benchmark's sections or "flops", axis title).
COSTS = (("flops", "forward FLOPs / dense (the study's)"),
         ("prefill", "prefill time / dense (measured)"),
         ("decode_b1", "decode time per token, batch 1 / dense (measured)"))

#: Which student loss of a run JSON is plotted: ``--loss`` → (value of one run JSON, how the page names it).
LOSSES = {"heldout": (METRIC["student loss"], "student held-out loss (the validation windows)"),
          "test": (field("test", "student_loss"), "student loss on the test windows (no choice read them)")}

#: The measured costs: the benchmark's workloads among ``COSTS``.
WORKLOADS = tuple(cost for cost, _ in COSTS if cost != "flops")


def workload_sources(timings: Sequence[Dict], mode: str) -> Dict[str, Dict]:
    """``{workload: the timing file that supplies it}``: the last of ``timings`` with that workload in ``mode``."""
    return {workload: timing for timing in timings for workload in WORKLOADS
            if workload in timing["sections"].get(mode, {})}


def measured_costs(timings: Sequence[Dict], mode: str = "eager") -> Dict[str, Dict[str, float]]:
    """``{label: {workload: time / dense}}``: the benchmark's median of the rounds' ratios per workload, each
    workload from the file :func:`workload_sources` picks for it."""
    costs: Dict[str, Dict[str, float]] = {}
    for timing in timings:
        for label in timing["models"]:
            costs.setdefault(label, {})
    for workload, timing in workload_sources(timings, mode).items():
        times = timing["sections"][mode][workload]["times"]
        for label in timing["models"]:
            if label in times:
                costs[label][workload] = paired_ratio(times, label, "dense")
    return costs


def study_points(study_dir: Path, names: Sequence[str],
                 loss: str = "heldout") -> Dict[str, Tuple[float, Optional[float], int]]:
    """``{run: (student loss, forward FLOPs ratio, seeds)}``, means over the seeds the study has (``loss``: a key of
    ``LOSSES``; a seed without that loss is not counted)."""
    _, runs = load_results(study_dir)
    value = LOSSES[loss][0]
    out = {}
    for name in names:
        losses = [v for v in (value(r) for r in runs.get(name, [])) if v is not None]
        flops = [v for v in (METRIC["fwd FLOPs ratio"](r) for r in runs.get(name, [])) if v is not None]
        if losses:
            out[name] = (statistics.fmean(losses), statistics.fmean(flops) if flops else None, len(losses))
    return out


def line_at(points: List[Tuple[float, float]], cost: float) -> Optional[float]:
    """Loss of the piecewise-linear line through ``points`` ``[(cost, loss)]`` at ``cost``; None outside it."""
    points = sorted(points)
    for (c0, l0), (c1, l1) in zip(points, points[1:]):
        if c0 <= cost <= c1 and c1 > c0:
            return l0 + (l1 - l0) * (cost - c0) / (c1 - c0)
    return None


def _on_the_line(label: str) -> bool:
    """Layer dropping's line: the layer-dropping runs and dense (no layer dropped), its cheap and its costly end."""
    return label.startswith("layerdrop") or label == "dense"


def verdicts(costs: Dict[str, Dict[str, float]], losses: Dict[str, float]) -> List[Dict]:
    """Per recommended recipe and cost: its loss, the layer-dropping line's at its cost, the difference."""
    dropping = [label for label in costs if _on_the_line(label) and label in losses]
    rows = []
    for recipe in BASELINE_OF:
        if recipe not in costs or recipe not in losses:
            continue
        for cost, _ in COSTS:
            if cost not in costs[recipe]:
                continue
            line = line_at([(costs[d][cost], losses[d]) for d in dropping if cost in costs[d]], costs[recipe][cost])
            rows.append({"recipe": recipe, "cost": cost, "at": costs[recipe][cost], "loss": losses[recipe],
                         "line": line, "difference": None if line is None else losses[recipe] - line})
    return rows


def plot(path: Path, costs: Dict[str, Dict[str, float]], losses: Dict[str, float], loss_title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A run more than a nat behind dense (the papers' setting) would flatten every other point: named, not drawn.
    dense = losses.get("dense", min(losses.values()))
    off_chart = {label: loss for label, loss in losses.items() if loss > dense + 1.0}
    losses = {label: loss for label, loss in losses.items() if label not in off_chart}
    fig, axes = plt.subplots(1, len(COSTS), figsize=(5 * len(COSTS), 4.2), sharey=True)
    if off_chart:
        fig.suptitle("not drawn (more than 1 nat behind dense): "
                     + ", ".join(f"{label} {loss:.2f}" for label, loss in off_chart.items()), fontsize=8)
    for ax, (cost, title) in zip(axes, COSTS):
        dropping = sorted((costs[d][cost], losses[d], d) for d in costs
                          if _on_the_line(d) and d in losses and cost in costs[d])
        if dropping:
            ax.plot([c for c, _, _ in dropping], [l for _, l, _ in dropping], "s--", color="tab:gray",
                    label="layer dropping (and dense)")
        for label, value in costs.items():
            if label in losses and cost in value and not label.startswith("layerdrop"):
                color = "black" if label == "dense" else "tab:red" if label.startswith("hybrid") else "tab:blue"
                ax.plot(value[cost], losses[label], "o", color=color)
        for label, value in costs.items():
            if label in losses and cost in value:
                ax.annotate(label, (value[cost], losses[label]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{loss_title}, mean over seeds".replace(" (", "\n("))
    if axes[0].get_legend_handles_labels()[0]:  # the layer-dropping line drawn
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(study_dir: Path, timing_paths: Sequence[Path], timings: Sequence[Dict], costs, losses, seeds, rows,
             mode: str, loss: str, stem: str) -> str:
    names = {label: name for label, _, name in SMOLLM2_RECIPES}
    options = "".join(f" --{key} {value}" for key, value, default in (("mode", mode, "eager"), ("loss", loss, "heldout"))
                      if value != default)
    windows = "validation" if loss == "heldout" else "test"
    sources = workload_sources(timings, mode)
    timed = "; ".join(
        f"{', '.join(w for w, t in sources.items() if t is timing)}: `{timing['command']}` ({timing['date']}, "
        f"{timing['device']}; {mode}; median over {timing['rounds']} interleaved rounds of time / dense)"
        for timing in timings if any(t is timing for t in sources.values()))
    lines = [f"# {study_dir.name}: the frontier in time ({mode}, loss on the {windows} windows)", "",
             f"Written by `python experiments/frontier_in_time.py --study {study_dir.as_posix()} --timing "
             f"{' '.join(p.as_posix() for p in timing_paths)}{options}`. Loss: the study's {LOSSES[loss][1]}, mean "
             f"over the seeds it has. Time, {timed}, random weights of each run's shape. FLOPs: the study's (closed "
             "form at the executed fractions it measured on the held-out windows).", "",
             f"![{stem}.png]({stem}.png)", "",
             "| benchmark label | study run | seeds | student loss | FLOPs | prefill time | decode time (b1) | "
             "executed in the timed decode |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    # The timed decode's threshold students run what they run on the benchmark's random weights and token stream:
    # a model that ran more than its budget there is timed above its cost.
    decoded = sources["decode_b1"]["sections"][mode]["decode_b1"].get("executed_fraction", {}) \
        if "decode_b1" in sources else {}
    for label, value in costs.items():
        fractions = decoded.get(label) or {}
        ran = f"{statistics.fmean(fractions.values()):.2f}" if fractions else ""
        lines.append(f"| {label} | `{names.get(label, label)}` | {seeds.get(label, 0)} | {fmt(losses.get(label))} | "
                     f"{fmt(value.get('flops'))} | {fmt(value.get('prefill'))} | {fmt(value.get('decode_b1'))} | {ran} |")
    lines += ["", "## Each level's recipe against layer dropping at its cost", "",
              "Recipe loss − the layer-dropping line's loss at the recipe's cost (the line through the timed "
              "layer-dropping runs and dense, linear between neighbours; blank where the recipe's cost is outside it). "
              "Negative: the recipe is worth more than dropping layers at what it costs in that unit.", "",
              "| recipe | cost | recipe at | recipe loss | line at that cost | recipe − line |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['recipe']} | {row['cost']} | {row['at']:.3f} | {row['loss']:.3f} | {fmt(row['line'])} | "
                     + ("" if row["difference"] is None else f"{row['difference']:+.3f}") + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", type=Path, required=True, help="a study folder (its runs/*.json)")
    parser.add_argument("--timing", type=Path, nargs="+", required=True,
                        help="results.json of python -m benchmarks.compiled (several: each workload from the last "
                             "that times it)")
    parser.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    parser.add_argument("--loss", default="heldout", choices=sorted(LOSSES),
                        help="which student loss: held-out validation windows or the test windows")
    args = parser.parse_args(argv)
    timings = [json.loads(path.read_text()) for path in args.timing]
    for path, timing in zip(args.timing, timings):
        if timing.get("shape") != "smollm2":
            raise ValueError(f"{path} times the {timing.get('shape')!r} shape; the study's runs are SmolLM2's")
        if args.mode not in timing["sections"]:
            raise ValueError(f"{path} has no {args.mode} section (it has {sorted(timing['sections'])})")
    costs = measured_costs(timings, args.mode)
    names = {label: name for label, _, name in SMOLLM2_RECIPES}
    points = study_points(args.study, [names.get(label, label) for label in costs], args.loss)  # JSONs read once
    if not points:
        raise ValueError(f"{args.study} has no {args.loss} student loss for any timed run "
                         f"({', '.join(names.get(label, label) for label in costs)})")
    found = {label: points[names.get(label, label)] for label in costs if names.get(label, label) in points}
    losses = {label: loss for label, (loss, _, _) in found.items()}
    seeds = {label: n for label, (_, _, n) in found.items()}
    for label, (_, flops, _) in found.items():
        if flops is not None:
            costs[label] = {"flops": flops, **costs[label]}
    rows = verdicts(costs, losses)
    stem = "time_frontier" if (args.mode, args.loss) == ("eager", "heldout") else f"time_frontier_{args.mode}_{args.loss}"
    plot(args.study / f"{stem}.png", costs, losses, LOSSES[args.loss][1])
    page = markdown(args.study, args.timing, timings, costs, losses, seeds, rows, args.mode, args.loss, stem)
    (args.study / f"{stem}.md").write_text(page)
    print(page)
    return {"costs": costs, "losses": losses, "verdicts": rows, "page": args.study / f"{stem}.md"}


if __name__ == "__main__":
    main()
