"""The study page: ``aggregate`` writes ``<out_dir>/README.md`` and its figures from the run JSONs present.

The page holds a table of every run (mean ± std over the seeds present, "partial" where a run has fewer seeds than
the study or none), paired differences run − baseline per seed with a t-interval, the test-set table (paired by
seed and by window, bootstrap interval) where runs were scored on one, the study's ``comparisons`` (per level, the arms
that compete for one budget ranked on the test windows, each against the best), the figures (:mod:`experiments.plots`), the
papers' claims table with ``claims.png`` (predictor loss PriorFFN vs TPN, STT dynamic capacity per layer, CE/CU
shares of the teacher's choices over training, teacher–student agreement STT vs SDT; the verdicts, which need
three seeds, are ``experiments/frontier/claims.py``'s), and links to the run files.
"""

import json
import os
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from experiments.plots import GAP_KEY, TITLES, claims_plot, dynamic_runs, gaps_plot, make_plots, surprise_runs
from experiments.results import (METRIC, METRICS, Results, in_training_results, layer_mean_curve, layer_values,
                                 load_results, mean_curve, paired_curve_difference, unexplained_update_share)
from experiments.spec import run_id
from experiments.stats import finite, line_at, paired_difference, seed_window_bootstrap, slope
from experiments.training import stale_keys


def fmt_mean_std(values: Sequence[Optional[float]], digits: int) -> str:
    """``mean ± std`` of the finite values (one value alone, "–" for none)."""
    values = finite(values)
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _bootstrap_against(run: List[dict], base: List[dict], resamples: int) -> Optional[dict]:
    """Run − base on the test windows over the seeds both have (paired by seed and by window), or None."""
    base_by_seed = {r["seed"]: r["test"]["window_losses"] for r in base}
    pairs = [(r["test"]["window_losses"], base_by_seed[r["seed"]]) for r in run if r["seed"] in base_by_seed]
    return seed_window_bootstrap(pairs, resamples=resamples, seed=0) if pairs else None


def test_section(order: List[str], runs: Results, baselines: List[str], resamples: int = 2000) -> List[str]:
    """The test-set table (runs scored on the study's ``test`` windows), or nothing when no run was."""
    scored = {n: [r for r in runs.get(n, []) if r.get("test")] for n in order}
    scored = {n: rs for n, rs in scored.items() if rs}
    if not scored:
        return []
    first = next(iter(scored.values()))[0]["test"]
    lines = ["## Test set", "",
             f"Student loss per token on {first['windows']} windows × {first['seq_len']} tokens "
             f"({first['placement']} over `{Path(first['file']).name}`), works that no choice of this study looked at; "
             "each finished run is scored once. Δ = run − baseline, averaged over the seeds both have; 95 % interval "
             f"from {resamples} bootstrap resamples of seeds (paired by seed) and windows (paired by window).", ""]
    header = ["run", "seeds", "test loss"] + [f"Δ vs `{b}` | 95 % CI" for b in baselines]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * (3 + 2 * len(baselines)))
    for n, results in scored.items():
        cells = [f"`{n}`", str(len(results)), fmt_mean_std([r["test"]["student_loss"] for r in results], 3)]
        for base in baselines:
            boot = _bootstrap_against(results, scored.get(base, []), resamples) if n != base else None
            if boot is None:
                cells += ["–", "–"]
                continue
            cells += [f"{boot['mean']:+.3f} (n {boot['n_seeds']})",
                      f"[{boot['interval'][0]:+.3f}, {boot['interval'][1]:+.3f}]"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _bootstrap_against_line(run: List[dict], line: Dict[str, List[dict]], resamples: int) -> Optional[dict]:
    """Run − the baseline line at the run's measured FLOPs on the test windows: per seed the line's window losses
    interpolated between the line's runs of that seed that bracket the run's FLOPs (``stats.line_at``), then the
    seed × window bootstrap. Only seeds on which every run of the line was scored count: a seed missing one would be
    measured against a different line. None when no seed counts, or the run costs more than every line run."""
    pairs = []
    for r in run:
        points = [(METRIC["fwd FLOPs ratio"](m), m["test"]["window_losses"])
                  for results in line.values() for m in results if m["seed"] == r["seed"]]
        if len(points) < len(line):
            continue
        at = line_at(points, METRIC["fwd FLOPs ratio"](r))
        if at is not None:
            pairs.append((r["test"]["window_losses"], at))
    return seed_window_bootstrap(pairs, resamples=resamples, seed=0) if pairs else None


def _interval(boot: Optional[dict]) -> List[str]:
    """The two table cells of a bootstrap: mean (seeds) and interval, or dashes."""
    if boot is None:
        return ["–", "–"]
    return [f"{boot['mean']:+.3f} (n {boot['n_seeds']})", f"[{boot['interval'][0]:+.3f}, {boot['interval'][1]:+.3f}]"]


def comparison_section(comparison: dict, runs: Results, expected_seeds: Sequence[int],
                       resamples: int = 2000) -> List[str]:
    """One verdict of the study's ``comparisons``: the ranked arms (runs that compete for one budget, e.g. who
    makes a routed layer's decisions on one shape) ordered by test loss, each one's difference from the best with
    its seed × window bootstrap interval, the arms ``beside`` them (other FLOPs: not ranked) against the same best,
    and a sentence naming the best arm and its margin over the runner-up. With a ``line`` (runs at other FLOPs, e.g.
    layer dropping 7 and 8), each arm is also measured against that line at its own measured FLOPs, and a sentence
    says where the best arm falls: the question "does routing beat dropping more layers at equal cost"."""
    line_runs = list(comparison.get("line") or [])
    scored = {run: [r for r in runs.get(run, []) if r.get("test")] for run in
              dict.fromkeys([*comparison["ranked"].values(), *(comparison.get("beside") or {}).values(), *line_runs])}
    mean_loss = {run: statistics.fmean(r["test"]["student_loss"] for r in results)
                 for run, results in scored.items() if results}
    lines = [f"### {comparison['title']}", ""]
    ranked = sorted((label for label, run in comparison["ranked"].items() if run in mean_loss),
                    key=lambda label: mean_loss[comparison["ranked"][label]])
    if not ranked:
        return lines + ["No ranked arm has been scored on the test windows yet.", ""]
    best_label = ranked[0]
    best = comparison["ranked"][best_label]
    line = {run: scored[run] for run in line_runs}
    header = f"| arm | run | seeds | fwd FLOPs ratio | test loss | Δ vs best (`{best}`) | 95 % CI |"
    lines += [header + (" Δ vs the line at its FLOPs | 95 % CI |" if line else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|" if line else "")]
    rows = [(label, comparison["ranked"][label], "") for label in ranked]
    rows += [(label, run, "") for label, run in comparison["ranked"].items() if run not in mean_loss]
    rows += [(label, run, " (beside, not ranked)") for label, run in (comparison.get("beside") or {}).items()]
    against_best = {}  # run: its bootstrap against the best (None: unscored, the best itself, or no seed shared)
    for label, run, note in rows:
        results = scored[run]
        cells = [f"{label}{note}", f"`{run}`", str(len(results)),
                 fmt_mean_std([METRIC["fwd FLOPs ratio"](r) for r in results], 3),
                 fmt_mean_std([r["test"]["student_loss"] for r in results], 3)]
        boot = against_best[run] = _bootstrap_against(results, scored[best], resamples) if run != best else None
        cells += _interval(boot) if boot else ["best" if run == best else "–", "–"]
        if line:  # a run of the line is on it by definition
            cells += ["on the line", "–"] if run in line else _interval(_bootstrap_against_line(results, line, resamples))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if len(ranked) > 1:
        runner_label = ranked[1]
        boot = against_best[comparison["ranked"][runner_label]]
        if boot is None:
            lines.append(f"Best: {best_label} (`{best}`); it shares no seed with the runner-up {runner_label} yet.")
        else:
            low, high = boot["interval"]
            separated = "the interval excludes 0" if low > 0 else "the interval includes 0: not separated"
            if boot["n_seeds"] < 2:
                separated += " (one seed: the interval covers text sampling, not training noise)"
            lines.append(f"Best: {best_label} (`{best}`, test loss {mean_loss[best]:.3f}), ahead of the runner-up "
                         f"{runner_label} by {boot['mean']:.3f} nats [{low:+.3f}, {high:+.3f}] over {boot['n_seeds']} "
                         f"paired seed(s) × {boot['windows']} windows; {separated}.")
    if line:
        lines.append(_line_verdict(best_label, best, scored[best], line, resamples))
    short = [f"`{run}` ({len(scored[run])})" for run in scored if len(scored[run]) < len(expected_seeds)]
    if short:
        lines.append(f"Partial: fewer than {len(expected_seeds)} seeds scored for {', '.join(short)}.")
    return lines + [""]


def _line_verdict(label: str, run: str, results: List[dict], line: Dict[str, List[dict]], resamples: int) -> str:
    """The sentence that places the best arm against the line at its own FLOPs."""
    through = ", ".join(f"`{name}` ({statistics.fmean(METRIC['fwd FLOPs ratio'](r) for r in rs):.3f})"
                        for name, rs in line.items() if rs)
    boot = _bootstrap_against_line(results, line, resamples)
    if boot is None:
        return (f"Against the line through {through or 'its runs'}: {label} (`{run}`) shares no seed on which every "
                "run of the line was scored yet.")
    flops = statistics.fmean(METRIC["fwd FLOPs ratio"](r) for r in results)
    cheapest = min((statistics.fmean(METRIC["fwd FLOPs ratio"](r) for r in rs) for rs in line.values() if rs))
    where = (f" (it costs less than every run of the line: measured against the cheapest, which spends more)"
             if flops < cheapest else "")
    low, high = boot["interval"]
    side = ("below the line: better than dropping layers at its cost" if high < 0 else
            "above the line: worse than dropping layers at its cost" if low > 0 else
            "the interval includes 0: level with the line")
    if boot["n_seeds"] < 2:
        side += " (one seed: the interval covers text sampling, not training noise)"
    return (f"Against the line through {through}, interpolated per seed at the arm's measured FLOPs: {label} "
            f"(`{run}`, {flops:.3f}) is {boot['mean']:+.3f} nats [{low:+.3f}, {high:+.3f}] over {boot['n_seeds']} "
            f"paired seed(s) × {boot['windows']} windows{where}; {side}.")


def comparisons_section(comparisons: Sequence[dict], runs: Results, expected_seeds: Sequence[int]) -> List[str]:
    """The study's verdict tables (``comparisons`` in the study file), or nothing when it has none."""
    if not comparisons:
        return []
    lines = ["## Verdicts on the test windows", "",
             "Per comparison, the ranked arms compete for one budget; Δ = arm − the best ranked arm (lowest mean test "
             "loss over its seeds), averaged over the seeds both have, with a 95 % interval from 2000 bootstrap "
             "resamples of seeds (paired by seed) and windows (paired by window). Arms beside the ranking (other FLOPs) "
             "are measured against the same best. Where a comparison names a line (layer dropping at neighbouring "
             "FLOPs), every arm is also measured against it: per seed, the line's window losses interpolated linearly "
             "in FLOPs between its two runs that bracket the arm's measured FLOPs (the cheapest run's below them all), "
             "then the same bootstrap.", ""]
    for comparison in comparisons:
        lines += comparison_section(comparison, runs, expected_seeds)
    return lines


def paired_section(base: str, order: List[str], runs: Results) -> List[str]:
    """The table of per-seed differences run − ``base`` (student loss, MC accuracy, FLOPs) with t-intervals."""
    paired_metrics = [("student loss", "Δ student loss"), ("MC acc", "Δ MC acc"), ("fwd FLOPs ratio", "Δ FLOPs ratio")]
    lines = [f"## Paired differences against `{base}`", "",
             "Per seed: run − baseline on the same seed (same data order and routing initialisation); mean, "
             "standard error and 95 % interval from Student's t with n − 1 degrees of freedom (n = seeds both have).", ""]
    lines.append("| run | n | " + " | ".join(f"{label} mean | SE | 95 % CI" for _, label in paired_metrics) + " |")
    lines.append("|" + "---|" * (2 + 3 * len(paired_metrics)))
    base_by_seed = {r["seed"]: r for r in runs.get(base, [])}
    unpaired = []
    for n in order:
        if n == base:
            continue
        cells = [f"`{n}`"]
        pairs = [(r, base_by_seed[r["seed"]]) for r in runs.get(n, []) if r["seed"] in base_by_seed]
        if not pairs:
            unpaired.append(f"`{n}`")
            continue
        cells.append(str(len(pairs)))
        for metric, _ in paired_metrics:
            fn = METRIC[metric]
            diffs = [fn(a) - fn(b) for a, b in pairs if fn(a) is not None and fn(b) is not None]
            pd = paired_difference(diffs)
            if pd["mean"] is None:
                cells += ["–", "–", "–"]
                continue
            cells.append(f"{pd['mean']:+.3f}")
            cells.append("–" if pd["se"] is None else f"{pd['se']:.3f}")
            cells.append("– (n < 2)" if pd["ci95"] is None else f"[{pd['ci95'][0]:+.3f}, {pd['ci95'][1]:+.3f}]")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if not base_by_seed:
        lines += [f"Baseline `{base}` has no finished seed yet: no pairs.", ""]
    elif unpaired:
        lines += [f"No seed paired with `{base}` yet: {', '.join(unpaired)}.", ""]
    return lines


def in_training_label(partial: dict) -> str:
    """A gaps row of a run still training: its name, seed and how far it has come."""
    planned = partial.get("planned_steps")
    return (f"{partial['name']} (seed {partial['seed']}, in training: step {partial['steps']}"
            + (f" of {planned})" if planned else ")"))


def gaps_section(out_dir: Path, order: List[str], runs: Results, baselines: List[str],
                 in_training: Optional[Results] = None) -> List[str]:
    """Each run's validation loss minus each of ``baselines`` (the study's ``gaps``) at every validation step, paired
    by seed, as tables and as ``gaps.png``: whether a gap closes or widens with training. ``in_training`` (partial
    results of runs still training, :func:`in_training_results`) adds a row per such (run, seed) for the steps it
    has validated so far, marked as in training. Empty when no row shares a step with a baseline."""
    in_training = in_training or {}
    curves, running = {}, set()
    for base in baselines:
        by_row = {n: paired_curve_difference(runs[n], runs.get(base, []), GAP_KEY)
                  for n in order if n != base and runs.get(n)}
        for n in order:
            for partial in in_training.get(n, []) if n != base else []:
                label = in_training_label(partial)
                by_row[label] = paired_curve_difference([partial], runs.get(base, []), GAP_KEY)
                running.add(label)
        by_row = {n: c for n, c in by_row.items() if c[0]}
        if by_row:
            curves[base] = by_row
    if not curves:
        return []
    gaps_plot(out_dir, curves, running)
    lines = ["## Gaps during training", "",
             f"Validation loss (`{GAP_KEY}`: the student, on the validation works) of each run minus the baseline's at "
             "the same optimizer step, mean over the seeds both have (n). The finished runs' test-window differences "
             "are the tables above; these show how each gap moved while training."
             + (" Rows marked *in training* are runs that have not finished, read from their training logs on the "
                "machine that wrote this page (dashed in the plot): partial, unscored, and in no other table."
                if running else ""), ""]
    for base, by_row in curves.items():
        steps = sorted({s for c in by_row.values() for s in c[0]})
        lines += [f"### against `{base}`", "", "| run | " + " | ".join(f"step {s}" for s in steps) + " |",
                  "|" + "---|" * (1 + len(steps))]
        for label, (row_steps, diffs, seeds) in by_row.items():
            cell = {s: f"{d:+.3f} ({k})" for s, d, k in zip(row_steps, diffs, seeds)}
            lines.append(f"| `{label}` | " + " | ".join(cell.get(s, "–") for s in steps) + " |")
        lines.append("")
    lines += ["![gaps.png](gaps.png)", ""]
    return lines


def claims_section(names: List[str], runs: Results, plotted: Optional[List[str]] = None) -> List[str]:
    """The papers' claims table: per SDT/STT run its predictor loss over training, the held-out share of the update
    its predictor leaves unexplained, the CE/CU shares of its teacher's choices early → late, its agreement; and
    for each dynamic-capacity run that ``claims.png`` draws (``plotted``, None: all), its executed fraction per
    layer with its slope over depth."""
    surprise = surprise_runs(names, runs)
    drawn = set(names if plotted is None else plotted)
    lines = ["## The papers' claims", "",
             "| run | variant | seeds | predictor loss first → last | update share unexplained (held-out D_ch/D_st) "
             "| CE share first → last | CU share first → last | agreement (held-out) |", "|---|---|---|---|---|---|---|---|"]
    for n in surprise:
        rs = runs[n]
        _, pred = mean_curve(rs, "loss/pred")
        _, ce = layer_mean_curve(rs, "teacher_ce_share")
        _, cu = layer_mean_curve(rs, "teacher_cu_share")
        agreement = layer_values(rs, "teacher/agreement_accuracy")
        fmt = lambda v: f"{v[0]:.3g} → {v[-1]:.3g}" if v else "–"  # noqa: E731
        mean_agreement = f"{statistics.fmean(agreement.values()):.3f}" if agreement else "–"
        unexplained = unexplained_update_share(rs)
        unexplained = "–" if unexplained is None else f"{unexplained:.3f}"
        lines.append(f"| {n} | {rs[0]['variant']} | {len(rs)} | {fmt(pred)} | {unexplained} | {fmt(ce)} | {fmt(cu)} "
                     f"| {mean_agreement} |")
    for n in dynamic_runs(names, runs):
        fractions = layer_values(runs[n], "teacher/teacher_fraction")
        if fractions and n in drawn:
            fitted = slope([float(l) for l in fractions], list(fractions.values()))
            lines += ["", f"Dynamic capacity (`{n}`, held-out, teacher g ≥ g_th): per layer "
                      + ", ".join(f"{l}: {v:.2f}" for l, v in fractions.items())
                      + (f"; least-squares slope {fitted:+.4f} per layer (negative = falls with depth)."
                         if fitted is not None else ".")]
    if not surprise:
        lines.append("| (no SDT/STT run yet) | | | | | | | |")
    return lines + ["", "![claims.png](claims.png)", ""]


def aggregate(out_dir: Path, in_training: bool = False) -> Path:
    """Write ``<out_dir>/README.md`` and the plots from the run JSONs present (a partial study is fine). With
    ``in_training``, the gaps section also shows the runs still training on this machine (their logs in the
    study's ``work_dir``)."""
    out_dir = Path(out_dir)
    spec, runs = load_results(out_dir)
    finished = dict(runs)  # stale results included: a run with a result JSON is not in training
    stale_lines = []
    for run_spec in spec.get("runs", []):
        if run_spec["name"] not in runs or not Path(run_spec["config"]).is_file():
            continue
        current = []
        for result in runs[run_spec["name"]]:
            keys = stale_keys(spec, run_spec, result)
            current.append(result) if not keys else stale_lines.append(
                f"- `{run_id(result['name'], result['seed'])}`: trained with other {', '.join(keys)} than the study now defines")
        runs[run_spec["name"]] = current
    runs = {n: rs for n, rs in runs.items() if rs}
    expected_names = [r["name"] for r in spec.get("runs", [])]
    order = expected_names + sorted(n for n in runs if n not in expected_names)
    expected_seeds = [int(s) for s in spec.get("seeds", [])]
    baselines = [b for b in spec.get("baselines", [])]
    name = spec.get("name") or next((r["study"] for rs in runs.values() for r in rs), out_dir.name)
    dense_names = [n for n in order if runs.get(n) and all(r.get("variant") == "dense" for r in runs[n])]

    missing_lines = []
    status = {}
    for n in order:
        seeds = [r["seed"] for r in runs.get(n, [])]
        lacking = [s for s in expected_seeds if s not in seeds]
        if not seeds:
            status[n] = "none (missing)"
            missing_lines.append(f"- `{n}`: no seed finished (expected {expected_seeds})")
        elif lacking:
            status[n] = f"{len(seeds)}/{len(expected_seeds)} (partial)"
            missing_lines.append(f"- `{n}`: seeds {lacking} missing (have {seeds})")
        else:
            status[n] = f"{len(seeds)}" + (f"/{len(expected_seeds)}" if expected_seeds else "")
    partial = bool(missing_lines)

    lines = [f"# Study `{name}`", ""]
    lines.append("Written by `python experiments/study.py aggregate` from the run JSONs in `runs/` "
                 f"({sum(len(v) for v in runs.values())} files).")
    if spec.get("source"):
        lines.append(f"Study file: `{os.path.relpath(spec['source'], out_dir) if os.path.isabs(spec['source']) else spec['source']}`.")
    lines.append("")
    if not spec:
        lines += ["No `study.json` here (written by `run`): the expected runs and seeds are unknown, the tables show "
                  "the run files present.", ""]
    elif partial:
        lines += ["**PARTIAL STUDY** — missing:", "", *missing_lines, ""]
    else:
        lines += ["Complete: every run has every seed of the study.", ""]
    if stale_lines:
        lines += ["**Stale results, left out of every table** (the study file or a config changed after they "
                  "finished; `study.py run --rerun-stale` retrains them):", "", *stale_lines, ""]
    budget = spec.get("budget")
    heldout = spec.get("heldout") or {}
    if budget is not None:
        lines.append(f"Budget (every run): `{json.dumps(budget)}`; seeds {expected_seeds}; held-out "
                     f"{heldout.get('windows')} windows × {heldout.get('seq_len')} tokens.")
        lines.append("")

    lines += ["## Runs", "",
              "Mean ± std over the seeds present. FLOPs and KV ratios: closed form per token against the dense model of the "
              "same shape at the held-out length, with the student's executed fraction measured on the held-out windows; "
              "losses per token on the held-out windows (student = deployed causal routing; teacher = β at the schedule's "
              "end); MC acc = mean `acc` of the eleuther_eval tasks; executed = mean over routed layers.", ""]
    header = ["run", "seeds"] + [h for h, _, _ in METRICS]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for n in order:
        results = runs.get(n, [])
        cells = [f"`{n}`", status[n]] + [fmt_mean_std([fn(r) for r in results], d) for _, fn, d in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")

    for base in baselines:
        lines += paired_section(base, order, runs)

    lines += test_section(order, runs, baselines)
    lines += comparisons_section(spec.get("comparisons") or [], runs, expected_seeds)
    plots = make_plots(out_dir, order, runs, dense_names)
    lines += ["## Plots", ""]
    for plot in plots:
        lines += [f"### {TITLES[plot]}", "", f"![{plot}]({plot})", ""]
    names = [n for n in order if runs.get(n)]
    lines += gaps_section(out_dir, order, runs, list(spec.get("gaps") or []),
                          in_training_results(spec, finished) if in_training else None)
    claims_plot(out_dir, names, runs, spec.get("claims_runs"))
    lines += claims_section(names, runs, spec.get("claims_runs"))
    lines += ["## Run files", ""]
    for n in order:
        files = ", ".join(f"[seed {r['seed']}](runs/{run_id(n, r['seed'])}.json)" for r in runs.get(n, []))
        lines.append(f"- `{n}`: {files or 'none yet'}")
    lines.append("")
    readme = out_dir / "README.md"
    readme.write_text("\n".join(lines))
    print(f"== wrote {readme} and {', '.join(plots)}", flush=True)
    return readme
