"""Issue 14's targets, checked on whatever runs of the frontier study have landed.

    python experiments/frontier/targets.py [--study DIR] [--write]   # prints a Markdown table; --write: targets.md

Runs are grouped by the forward FLOPs they *measured* (closed form at the student's executed fractions on the
held-out windows), not by their names: a run belongs to a level (0.90, 0.81, 0.72 of dense) when its mean FLOPs
ratio is within ±0.03 of it; a run whose student executes far from its budget is listed as off-budget. The
baselines are the layer-dropping and random-routing runs (``layerdrop_4/7/10``, ``random_75/50/25``), wherever
their FLOPs fall; layer dropping trained with the routed recipes' distillation (``layerdrop_N_distill``) is part
of the layer-dropping family, which takes per seed the lower loss of the runs at the same FLOPs.
At each level the *best routed recipe* is the routed run (MoD/SDT/STT, any technique) furthest below layer
dropping at its own FLOPs (mean over seeds; the lowest mean loss while no layer-dropping run exists); the
comparisons are paired by seed, and a target is "met" only with three seeds and the margin the issue names:

1. best routed < layer dropping and < random routing *at the same FLOPs* by more than 2 standard errors of the
   paired difference (while the best recipe has fewer than three seeds, the best one with three is checked as
   well). A baseline family (the layer-dropping runs, or the random-routing runs, each with dense as its point at
   1.0) is measured at a few FLOPs only, so per seed it is interpolated linearly at the candidate's measured
   FLOPs between the two runs that bracket them: mixing those two models gives that point, and on a convex
   frontier the chord lies above the curve, so the comparison never favours the baseline. A candidate cheaper
   than the family's cheapest run is compared with that run, which then spends more FLOPs than the candidate.
   (Comparing with the level's nominal baseline instead would let a recipe buy its margin with FLOPs: 0.019
   more FLOPs than ``layerdrop_7`` is worth about 0.06 nats on the layer-dropping line.)
2. at ≈ 0.81: (papers − best) / (papers − dense) ≥ 0.70 (mean over seeds);
3. at ≈ 0.90: best − dense < 0.10 nats, where "best" is the recipe a user would deploy at that budget: the lowest
   mean loss among the routed runs that do not spend more than 0.90 of dense FLOPs (measured) and meet target 1
   against both baselines (three seeds). A recipe may not buy the bar with FLOPs above the level, nor with a
   loss that layer dropping or random routing matches; while no run qualifies, the best by margin is judged on
   the issue's words alone and the row says so;
4. surprise (best SDT/STT) vs MoD (best MoD) at each level: the paired difference, either way; and for every
   SDT/STT run whose recipe also ran with MoD (``stt_X`` and ``mod_X``), that same-recipe difference.

The study names the runs of two roles in its ``claims:`` section (``study_claims``: the study folder's
``study.json``, else the study file it was run from, else the frontier study's, as for ``claims.py``): ``dense``, and
``papers``, the papers' setting (γ 0.5 on every other inner layer, no technique: ``stt_papers_50``), which target 2
measures from and which is never a candidate recipe; its ``ablations`` name the technique ablations of the last
tables (``{run without any technique: {technique: run with it}}``).

A diagnostic row, not a target, follows each level's layer-dropping comparison: the same best recipe's
*teacher* (the training router, which needs the dense pass and is not deployed) against layer dropping, which
tells whether the routing decision or the causal student that imitates it is what loses. The teacher is
compared at its own FLOPs (top-k at γ: ``teacher_flops_by_seed``), or at the student's where the run files do
not carry the teacher's fractions. A last table puts every routed run against layer dropping at its FLOPs.
"""

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))  # run as a script: the checkout's experiments package

from experiments import stats  # noqa: E402
from experiments.evaluation import compute_summary  # noqa: E402
from experiments.results import ROUTED_VARIANTS, load_results  # noqa: E402

LEVELS = ("0.90", "0.81", "0.72")  # fractions of dense forward FLOPs
TOLERANCE = 0.03
ROUTED = ROUTED_VARIANTS  # the variants that route tokens (mod, sdt, stt): one list, the driver's
SEEDS_NEEDED = 3
TARGET_ROLES = ("dense", "papers")  # the runs targets_table reads by role from the study's claims section


def study_claims(out_dir: Path) -> Dict[str, Any]:
    """The ``claims`` section (runs by role) of the study whose runs ``out_dir`` holds: its ``study.json``'s, else
    that of the study file it names as its source, else the frontier study's (``study.yaml`` beside this script);
    empty when none has one."""
    from omegaconf import OmegaConf

    spec_path = Path(out_dir) / "study.json"
    spec = json.loads(spec_path.read_text()) if spec_path.is_file() else {}
    sections = [spec.get("claims")]
    for source in (spec.get("source"), HERE / "study.yaml"):
        if source and Path(source).is_file():
            sections.append(OmegaConf.to_container(OmegaConf.load(source)).get("claims"))
    return next((section for section in sections if section), {})


def target_roles(out_dir: Path) -> Dict[str, Any]:
    """The study's claims section, checked to name a run for each of ``TARGET_ROLES``."""
    roles = study_claims(out_dir)
    missing = [role for role in TARGET_ROLES if role not in roles]
    if missing:
        raise ValueError(f"the study's claims section names no run for {missing} (targets.py reads "
                         f"{list(TARGET_ROLES)} and ablations)")
    return roles


def flops_ratio(results) -> float:
    return statistics.fmean(r["compute"]["forward_flops_ratio"] for r in results)


def level_of(results):
    ratio = flops_ratio(results)
    for level in LEVELS:
        if abs(ratio - float(level)) <= TOLERANCE:
            return level
    return None


def by_seed(results, key: str = "student_loss"):
    return {r["seed"]: r["heldout"][key] for r in results if r["heldout"].get(key) is not None}


def flops_by_seed(results):
    return {r["seed"]: r["compute"]["forward_flops_ratio"] for r in results}


def teacher_flops_by_seed(results):
    """Per seed, the FLOPs of the run's teacher selection (closed form at the teacher's held-out fraction per
    routed layer, top-k at γ): a student that under- or over-runs its budget does not move its teacher's cost.
    Empty when the run files do not carry the teacher's fractions and the config."""
    out = {}
    for r in results:
        executed = {int(layer): row["teacher/teacher_fraction"] for layer, row in (r.get("layers") or {}).items()
                    if row.get("teacher/teacher_fraction") is not None}
        if executed and r.get("config"):
            out[r["seed"]] = compute_summary(r["config"], executed, r["heldout"]["seq_len"])["forward_flops_ratio"]
    return out


def family_at(points, flops: float):
    """A baseline family's loss at ``flops``: ``points`` are its (FLOPs, loss) at one seed; linear between the two
    that bracket ``flops``, the cheapest point's loss below them all, None above them all, the lower loss where two
    runs share FLOPs (``stats.line_at`` with one value per run)."""
    value = stats.line_at([(x, [loss]) for x, loss in points], flops)
    return None if value is None else value[0]


def matched(candidate, family, runs, losses, at=None):
    """Per seed: the family's loss interpolated at the candidate's measured FLOPs (``family_at``; ``at``: other
    FLOPs per seed, e.g. its teacher's), and a label naming the runs it rests on, e.g. ``layer dropping at
    0.832 (layerdrop_7 0.813 ↔ layerdrop_4 0.893)``."""
    members = {n: flops_by_seed(runs[n]) for n in family}
    at = at or flops_by_seed(runs[candidate])
    values = {}
    for seed, flops in at.items():
        points = [(members[n][seed], losses[n][seed]) for n in family if seed in losses[n] and seed in members[n]]
        value = family_at(points, flops)
        if value is not None:
            values[seed] = value
    x = statistics.fmean(at.values())
    # Runs at the same FLOPs (with and without distillation) are one point of the line: name them together.
    at_flops: Dict[float, List[str]] = {}
    for n in family:
        at_flops.setdefault(round(statistics.fmean(members[n].values()), 3), []).append(n)
    nominal = sorted((f, " / ".join(sorted(names))) for f, names in at_flops.items())
    below = [(f, n) for f, n in nominal if f <= x]
    above = [(f, n) for f, n in nominal if f > x]
    if not below:
        where = f"{above[0][1]} ({above[0][0]:.3f}, more FLOPs)"
    else:
        where = f"{below[-1][1]} {below[-1][0]:.3f} ↔ {above[0][1]} {above[0][0]:.3f}" if above else below[-1][1]
    return values, f"at {x:.3f} ({where})"


def paired(a, b):
    """Per-seed a − b over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    return stats.paired_difference([a[s] - b[s] for s in seeds])


def lower_by_two_se(pd) -> bool:
    """Target 1's margin: the paired difference below 0 by more than 2 standard errors."""
    return pd["se"] is not None and pd["mean"] < 0 and -pd["mean"] > 2 * pd["se"]


def fmt(pd):
    if pd["n"] == 0:
        return "no common seed"
    if pd["se"] is None:
        return f"{pd['mean']:+.3f} (n = 1)"
    return f"{pd['mean']:+.3f} ± {pd['se']:.3f} se (n = {pd['n']})"


def verdict(ok: bool, n: int) -> str:
    if n < SEEDS_NEEDED:
        return f"not yet ({n}/{SEEDS_NEEDED} seeds)"
    return "met" if ok else "not met"


def which_wins(pd, below: str = "surprise routing lower", above: str = "MoD lower", pending: str = "not yet") -> str:
    """A difference answered either way once three seeds are in: ``below`` when it is below 0 by more than 2 se,
    ``above`` when above, or a tie (by default surprise − MoD: who is lower)."""
    if pd["n"] < SEEDS_NEEDED:
        return f"{pending} ({pd['n']}/{SEEDS_NEEDED} seeds)"
    if abs(pd["mean"]) <= 2 * pd["se"]:
        return "answered: no difference beyond 2 se"
    return f"answered: {below}" if pd["mean"] < 0 else f"answered: {above}"


def targets_table(out_dir: Path) -> str:
    """The Markdown table of every target on the run JSONs under ``out_dir/runs``."""
    _, runs = load_results(out_dir)
    roles = target_roles(out_dir)
    dense_run, papers_run = roles["dense"], roles["papers"]
    losses = {name: by_seed(results) for name, results in runs.items()}
    teacher_losses = {name: by_seed(results, "teacher_loss") for name, results in runs.items()}
    variant = {name: results[0]["variant"] for name, results in runs.items()}
    dense = losses.get(dense_run, {})
    lines = ["| level | target | runs | numbers | verdict |", "|---|---|---|---|---|"]
    off_budget = [n for n in losses if variant[n] in ROUTED and level_of(runs[n]) is None]
    families = {kind: [n for n in losses if variant[n] in (kind, "dense")] for kind in ("layerdrop", "random")}
    families = {kind: members for kind, members in families.items() if any(variant[n] == kind for n in members)}

    @functools.lru_cache(maxsize=None)
    def student_vs(name, kind):
        """The run's student − the ``kind`` family at its FLOPs (paired by seed), the line's label, and the family's
        per-seed losses there; computed once per (run, family) for the ranking, the verdicts and the tables."""
        baseline, where = matched(name, families[kind], runs, losses)
        return paired(losses[name], baseline), where, baseline

    def margin(name):  # mean over seeds of student − layer dropping at the run's FLOPs
        if "layerdrop" not in families:
            return statistics.fmean(losses[name].values())
        pd = student_vs(name, "layerdrop")[0]
        return pd["mean"] if pd["n"] else math.inf

    def beats_both_baselines(name):  # target 1 met against layer dropping and random routing, three seeds
        for kind in ("layerdrop", "random"):
            if kind not in families:
                return False
            pd = student_vs(name, kind)[0]
            if pd["n"] < SEEDS_NEEDED or not lower_by_two_se(pd):
                return False
        return True

    for level in LEVELS:
        routed = [n for n in losses if variant[n] in ROUTED and level_of(runs[n]) == level and n != papers_run]
        if not routed:
            lines.append(f"| {level} | all | – | no routed run yet | not yet |")
            continue
        margins = {n: margin(n) for n in routed}
        best = min(routed, key=margins.get)
        # A new recipe leads on fewer seeds: the best one with every seed is checked too, so a verdict that
        # three seeds already settled stays in the table.
        complete = [n for n in routed if len(losses[n]) >= SEEDS_NEEDED]
        best_complete = min(complete, key=margins.get) if complete else None
        candidates = [best] + ([best_complete] if best_complete not in (None, best) else [])
        for candidate in candidates:
            label = "best" if candidate == best else "best with 3 seeds"
            for kind, name in (("layerdrop", "layer dropping"), ("random", "random routing")):
                if kind not in families:
                    lines.append(f"| {level} | {label} < {name} at its FLOPs by > 2 se | {candidate} | no {kind} run yet "
                                 "| not yet |")
                    continue
                pd, where, baseline = student_vs(candidate, kind)
                ok = lower_by_two_se(pd)
                lines.append(f"| {level} | {label} < {name} at its FLOPs by > 2 se | {candidate} − {name} {where} "
                             f"| {fmt(pd)} | {verdict(ok, pd['n'])} |")
                if kind == "layerdrop" and teacher_losses[candidate]:
                    at = teacher_flops_by_seed(runs[candidate])
                    if at:
                        baseline, where = matched(candidate, families[kind], runs, losses, at)
                    pd = paired(teacher_losses[candidate], baseline)
                    answered = which_wins(pd, below="teacher lower", above="layer dropping lower", pending="diagnostic")
                    lines.append(f"| {level} | diagnostic: its teacher (not deployed) vs {name} | {candidate} "
                                 f"teacher − {name} {where} | {fmt(pd)} | {answered} |")
        if level == "0.81":
            papers = losses.get(papers_run, {})
            for candidate in candidates:
                seeds = sorted(set(papers) & set(dense) & set(losses[candidate]))
                if seeds:
                    closed = [(papers[s] - losses[candidate][s]) / (papers[s] - dense[s]) for s in seeds]
                    mean = statistics.fmean(closed)
                    lines.append(f"| 0.81 | closes ≥ 70 % of papers→dense gap | {candidate} vs {papers_run}, "
                                 f"{dense_run} | {mean:.0%} closed (n = {len(seeds)}) | "
                                 f"{verdict(mean >= 0.70, len(seeds))} |")
                else:
                    lines.append(f"| 0.81 | closes ≥ 70 % of papers→dense gap | {candidate} | {papers_run} or "
                                 f"{dense_run} missing | not yet |")
        if level == "0.90" and dense:
            deployable = [n for n in routed if flops_ratio(runs[n]) <= float(level) and beats_both_baselines(n)]
            if deployable:
                chosen = min(deployable, key=lambda n: statistics.fmean(losses[n].values()))
                label = (f"within 0.10 nats of dense (lowest loss at ≤ {level} FLOPs among the recipes that beat "
                         "both baselines)")
                runs_cell = f"{chosen} − {dense_run} (at {flops_ratio(runs[chosen]):.3f})"
            else:
                # The words alone (the best recipe within 0.10 of dense), flagged in the label: no recipe
                # here is yet one worth deploying over layer dropping and random routing.
                label = (f"within 0.10 nats of dense (best by margin: no recipe at ≤ {level} FLOPs beats both "
                         "baselines on 3 seeds)")
                chosen, runs_cell = best, f"{best} − {dense_run}"
            pd = paired(losses[chosen], dense)
            ok = pd["mean"] is not None and pd["mean"] < 0.10
            lines.append(f"| 0.90 | {label} | {runs_cell} | {fmt(pd)} | {verdict(ok, pd['n'])} |")
        surprise = [n for n in routed if variant[n] in ("sdt", "stt")]
        mod = [n for n in routed if variant[n] == "mod"]
        if surprise and mod:
            s_best = min(surprise, key=lambda n: statistics.fmean(losses[n].values()))
            m_best = min(mod, key=lambda n: statistics.fmean(losses[n].values()))
            pd = paired(losses[s_best], losses[m_best])
            answered = which_wins(pd)
            lines.append(f"| {level} | surprise vs MoD (answered either way) | {s_best} − {m_best} | {fmt(pd)} | {answered} |")
        # The same recipe (placement and techniques) with MoD's router instead of the surprise decision.
        for name in surprise:
            twin = "mod_" + name.split("_", 1)[1]
            if twin in mod and (name, twin) != (s_best, m_best):  # the best pair is the row above
                pd = paired(losses[name], losses[twin])
                answered = which_wins(pd)
                lines.append(f"| {level} | surprise vs MoD, same recipe | {name} − {twin} | {fmt(pd)} | {answered} |")
    if "layerdrop" in families:
        lines += ["", "Every routed run against layer dropping at its own FLOPs: the student at its measured FLOPs, the "
                  "teacher (not deployed) at its own (top-k at γ; where a student under- or over-runs its budget "
                  "the two differ). Paired by seed, mean ± se; below 0: lower than layer dropping.", "",
                  "| run | student FLOPs | student − layer dropping | teacher FLOPs | teacher − layer dropping |",
                  "|---|---|---|---|---|"]
        routed_all = sorted((n for n in losses if variant[n] in ROUTED), key=lambda n: -flops_ratio(runs[n]))
        for name in routed_all:
            student = fmt(student_vs(name, "layerdrop")[0])
            teacher, teacher_at = "–", "–"
            at = teacher_flops_by_seed(runs[name])
            if teacher_losses[name] and at:
                baseline, _ = matched(name, families["layerdrop"], runs, losses, at)
                teacher, teacher_at = fmt(paired(teacher_losses[name], baseline)), f"{statistics.fmean(at.values()):.3f}"
            lines.append(f"| `{name}` | {flops_ratio(runs[name]):.3f} | {student} | {teacher_at} | {teacher} |")
    lines += technique_ablations(runs, losses, roles.get("ablations") or {})
    lines += price_of_compute(runs, losses, variant, dense_run)
    if off_budget:
        lines += ["", "Off budget (mean forward FLOPs ratio not within ±0.03 of a level): "
                  + ", ".join(f"`{n}` {flops_ratio(runs[n]):.3f}" for n in off_budget)]
    return "\n".join(lines)


TECHNIQUES = {"kv": "skipped tokens write K/V", "pred": "predicted skip update", "curr": "capacity curriculum",
              "distill": "distillation", "all": "every technique the variant has"}


def technique_ablations(runs, losses, ablations: Optional[Mapping[str, Mapping[str, str]]] = None) -> List[str]:
    """Each technique alone, and all of them, against the same variant without any (on the frontier, ``stt_50_kv``
    − ``stt_50``, γ 0.5 on every other inner layer): the issue's ablation on STT and MoD. ``ablations``: the study's
    ``claims.ablations``, {run without any technique: {technique: run with it}} (default: the frontier study's); a
    row for each pair with runs landed, by the name of the run with the technique."""
    if ablations is None:
        ablations = study_claims(HERE).get("ablations") or {}
    pairs = sorted((name, base, technique) for base, techniques in ablations.items()
                   for technique, name in techniques.items())
    unknown = sorted({technique for _, _, technique in pairs} - set(TECHNIQUES))
    if unknown:
        raise ValueError(f"claims.ablations names techniques {unknown}; known: {sorted(TECHNIQUES)}")
    rows = []
    for name, base, technique in pairs:
        if name not in losses or base not in losses:
            continue
        pd = paired(losses[name], losses[base])
        kv = statistics.fmean(r["compute"]["kv_bytes_ratio"] for r in runs[name])
        answered = which_wins(pd, below="the technique lowers the loss", above="the technique raises the loss")
        rows.append(f"| `{name}` | {TECHNIQUES[technique]} | {flops_ratio(runs[name]):.3f} vs "
                    f"{flops_ratio(runs[base]):.3f} | {kv:.3f} | {fmt(pd)} | {answered} |")
    if not rows:
        return []
    return ["", "Technique ablations: each technique alone, and all of them, on the papers' setting (γ 0.5 on every "
            "other inner layer), against the same variant without any. Paired by seed, mean ± se; below 0: the "
            "technique lowers the student's loss.", "",
            "| run | technique | FLOPs (vs without) | KV bytes | student − without | verdict |",
            "|---|---|---|---|---|---|"] + rows


def price_of_compute(runs, losses, variant, dense_run: str = "dense") -> List[str]:
    """What each unit of forward FLOPs saved costs in held-out loss: per seed (student − dense) / (1 − FLOPs ratio),
    for layer dropping and every routed run. A recipe beats layer dropping at a level only where its price there
    is below layer dropping's average price at the same FLOPs, which rises with every layer dropped."""
    dense = losses.get(dense_run, {})
    names = [n for n in losses if variant[n] in ROUTED + ("layerdrop",)]
    if not dense or not names:
        return []
    rows = []
    for name in sorted(names, key=lambda n: -flops_ratio(runs[n])):
        flops = flops_by_seed(runs[name])
        prices = {s: (loss - dense[s]) / (1.0 - flops[s]) for s, loss in losses[name].items()
                  if s in dense and s in flops and flops[s] < 1.0}
        if prices:
            mean_se = fmt(paired(prices, dict.fromkeys(prices, 0.0)))  # prices − 0: mean ± se over the seeds
            rows.append(f"| `{name}` | {flops_ratio(runs[name]):.3f} | {mean_se} |")
    return ["", "The price of compute: nats of held-out student loss per unit of forward FLOPs saved, (student − dense) "
            "/ (1 − FLOPs ratio), paired with dense by seed (mean ± se), for layer dropping and every routed run.",
            "", "| run | FLOPs | nats per unit of FLOPs saved |", "|---|---|---|"] + rows


def command_line(script: str, study: Path) -> str:
    """The command that regenerates ``script``'s table for ``study``, as the written page quotes it: the frontier
    study is the default, so it needs no ``--study``, however the path to it was spelt (``./``, ``..``, absolute)."""
    return f"python experiments/frontier/{script}" + ("" if study.resolve() == HERE else f" --study {study}")


def print_or_write(description: str, make_table, file_name: str, heading: str, about: str) -> str:
    """The command line of this script and of ``claims.py``: print ``make_table(study folder)``; ``--study DIR``
    checks another study's runs (default: the frontier study); ``--write`` also writes the table to ``file_name``
    in that folder under a heading and a line saying how it was made (``about``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--study", type=Path, default=HERE, help="study folder holding runs/ (default: %(default)s)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if not (args.study / "runs").is_dir():
        parser.error(f"--study {args.study}: no runs/ folder there (expected a study's out_dir)")
    table = make_table(args.study)
    if args.write:
        command = command_line(file_name.replace(".md", ".py"), args.study)
        (args.study / file_name).write_text(f"# {heading}\n\nWritten by `{command} --write`; {about}\n\n{table}\n")
    print(table)
    return table


def main() -> str:
    return print_or_write(__doc__.split("\n\n")[0], targets_table, "targets.md",
                          "Issue 14 targets on the runs so far", "student held-out loss per token, paired by seed.")


if __name__ == "__main__":
    main()
