"""The papers' qualitative claims (issue 14, item 4), each given a verdict on the frontier study's runs.

    python experiments/frontier/claims.py [--write]      # prints a Markdown table; --write: claims.md

Every claim is tested on the runs that share the papers' setting at our scale: γ = 0.5 on every other inner
layer, 60 steps from pretrained SmolLM2-135M. The study file names them by role (``claims:``; ``--study DIR`` takes
the section of the study file DIR's ``study.json`` names, a folder without one is judged with the frontier study's):
``mod``, ``sdt``, ``stt`` (the fixed-capacity variants; the frontier's ``mod_50``, ``sdt_50``, ``stt_50``),
``dynamic`` (STT with dynamic capacity, ``stt_dynamic``), the ablations ``larger_prior`` (``sdt_50_prior0_25``) and
``lora`` (``lora_stt_50``), and ``dense``. A number is per seed first (a run's own curve or held-out report), then a
mean ± standard error over seeds; two runs are compared by their per-seed difference. The verdict vocabulary is the
issue's:

- **reproduced**: with three seeds, the effect the papers state is there beyond 2 standard errors (for a claim
  of "no worse", no contrary effect beyond 2 se);
- **not reproduced**: with three seeds, the contrary effect is there beyond 2 se (for a claim of an effect,
  also: no effect beyond 2 se, written "not reproduced (no effect beyond 2 se)");
- **inconclusive (n/3 seeds)**: fewer than three seeds, whatever the numbers say so far.

The claims (paper section; ``sdt_stt_paper.txt`` lines 238–289):

1. Fig. 2A: the three fixed-capacity variants (MoD, SDT, STT at γ = 0.5) train stably — per seed, the mean
   training LM loss of the last 15 logged steps is finite and below that of the first 5 (the paper smooths with
   a 15-step moving average). STT with dynamic capacity is not in Fig. 2A, and this criterion cannot judge it:
   its threshold teacher starts by running every token (the pretrained model's loss) and sheds compute as it
   trains, so its loss rises with the compute it gives up. Its row shows the loss next to the teacher's executed
   fraction (mean over routed layers) over the same steps, without a verdict.
2. Fig. 2A: surprise routing trains at a rate comparable to MoD — SDT/STT − MoD in that final training loss is
   not above 0 beyond 2 se.
3. Fig. 2B: the temporal prior (STT's TPN) predicts the block's update more accurately than the spatial prior
   (SDT's PriorFFN, any size) — STT − SDT in the share of the update the predictor leaves unexplained (held-out
   D_ch / D_st, averaged over routed layers) below 0 beyond 2 se. Not the raw L_pred the paper plots: that mean
   MSE over layers is decided by whichever routed layer has massive activations (layer 11 here, D_st in the
   thousands against ≤ 35 elsewhere), so it compares layer 11's drift, not the predictors.
4. Fig. 2C: STT with dynamic capacity processes fewer tokens in deeper layers — the least-squares slope of the
   held-out share of tokens the threshold router runs (teacher, g ≥ g_th) against layer index is below 0
   beyond 2 se.
5. §5: routing shifts from novelty (CU) to prediction (CE) over training — per layer-averaged training curves,
   (CE share − CU share of the teacher's choices) over the last 10 steps minus over the first 10 is above 0
   beyond 2 se. Checked on ``sdt`` and ``stt``; every other SDT/STT run of the study is listed as well.
6. Causal-router agreement, STT vs SDT (asked by the issue, not a claim of the papers): held-out teacher–student
   agreement accuracy averaged over routed layers, answered either way.
7. Table 2: a lightweight PriorFFN is sufficient — the larger prior (f = 0.25) does not lower the held-out
   student loss of the default (f = 0.0625) beyond 2 se.
8. Table 2: full fine-tuning beats LoRA — LoRA − full in held-out student loss above 0 beyond 2 se (the papers
   ablate SDT; the study's LoRA run is STT).
9. Table 1: every conditional-compute variant underperforms the dense model — routed − dense in held-out student
   loss above 0 beyond 2 se, for each of MoD, SDT, STT fixed and dynamic.
"""

import math
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))  # run as a script: the checkout's experiments package

from experiments import stats  # noqa: E402
from experiments.frontier import targets  # noqa: E402
from experiments.results import layer_mean_curve, layer_values, load_results, unexplained_update_share  # noqa: E402

SEEDS_NEEDED = targets.SEEDS_NEEDED
FIRST_STEPS, LAST_STEPS = 5, 15        # claim 1–3: start and end of a training curve (the paper's 15-step EMA)
SHIFT_WINDOW = 10                      # claim 5: early and late windows of the CE/CU share curves
ROLES = ("dense", "mod", "sdt", "stt", "dynamic", "larger_prior", "lora")  # the runs a study names in ``claims:``
PAPER_VARIANTS = ("mod", "sdt", "stt", "dynamic")  # roles: the conditional-compute variants of Table 1
FIXED_CAPACITY = ("mod", "sdt", "stt")  # roles: the variants of Fig. 2A

PerSeed = Dict[int, float]


def _series(r, key: str) -> List[float]:
    values = ((r.get("curves") or {}).get("series") or {}).get(key) or []
    return [v for v in values if v is not None]


def curve_mean(key: str, window: slice) -> Callable[[dict], Optional[float]]:
    """A run's mean of the training curve ``key`` over ``window`` of its logged steps."""
    def value(r):
        values = _series(r, key)[window]
        return statistics.fmean(values) if values else None
    return value


def heldout_student_loss(r) -> Optional[float]:
    return (r.get("heldout") or {}).get("student_loss")


def depth_slope(r) -> Optional[float]:
    """Least-squares slope of the held-out threshold-router share (teacher) against layer index."""
    fractions = layer_values([r], "teacher/teacher_fraction")
    return stats.slope([float(layer) for layer in fractions], list(fractions.values())) if fractions else None


def teacher_fraction_mean(window: slice) -> Callable[[dict], Optional[float]]:
    """A run's teacher executed fraction, averaged over routed layers and over ``window`` of its logged steps."""
    def value(r):
        _, fractions = layer_mean_curve([r], "teacher_fraction")
        fractions = [v for v in fractions[window] if v is not None]
        return statistics.fmean(fractions) if fractions else None
    return value


def ce_over_cu_shift(r) -> Optional[float]:
    """(CE share − CU share) of the teacher's choices, late minus early in training, averaged over layers."""
    _, ce = layer_mean_curve([r], "teacher_ce_share")
    _, cu = layer_mean_curve([r], "teacher_cu_share")
    if len(ce) < 2 * SHIFT_WINDOW or len(cu) != len(ce):
        return None
    margin = [a - b for a, b in zip(ce, cu)]
    return statistics.fmean(margin[-SHIFT_WINDOW:]) - statistics.fmean(margin[:SHIFT_WINDOW])


def unexplained_share(r) -> Optional[float]:
    return unexplained_update_share([r])


def mean_agreement(r) -> Optional[float]:
    values = layer_values([r], "teacher/agreement_accuracy")
    return statistics.fmean(values.values()) if values else None


def per_seed(runs, name: str, metric: Callable[[dict], Optional[float]]) -> PerSeed:
    values = {}
    for r in runs.get(name, []):
        value = metric(r)
        if value is not None and math.isfinite(value):
            values[r["seed"]] = value
    return values


def one_sample(values: PerSeed):
    return stats.paired_difference([values[s] for s in sorted(values)])


def verdict(pd, claimed_sign: int, no_worse: bool = False) -> str:
    """The claim's verdict from a mean ± se whose sign the papers predict (``claimed_sign`` −1 or +1).

    ``no_worse``: the papers claim only that the contrary effect is absent (comparable, sufficient)."""
    if pd["n"] < SEEDS_NEEDED:
        return f"inconclusive ({pd['n']}/{SEEDS_NEEDED} seeds)"
    beyond = abs(pd["mean"]) > 2 * pd["se"]
    if beyond and math.copysign(1, pd["mean"]) == claimed_sign:
        return "reproduced"
    if beyond:
        return "not reproduced"
    return "reproduced (no contrary effect beyond 2 se)" if no_worse else "not reproduced (no effect beyond 2 se)"


def claim_runs(out_dir: Path) -> Dict[str, str]:
    """The run of each role (``ROLES``) the claims are tested on: the ``claims`` section of the study ``out_dir``
    holds (from its ``study.json``, else from the study file that names as its source), else the frontier study's
    (``targets.study_claims``, which targets.py reads its roles from too)."""
    roles = targets.study_claims(out_dir)  # the frontier study's always has one
    missing = [role for role in ROLES if role not in roles]
    if missing:
        raise ValueError(f"the study's claims section names no run for {missing} (roles: {list(ROLES)})")
    return roles


def claims_table(out_dir: Path) -> str:
    """The Markdown table of every claim's verdict on the run JSONs under ``out_dir/runs``."""
    _, runs = load_results(out_dir)
    role = claim_runs(out_dir)
    rows: List[str] = []

    def row(claim: str, compared: str, numbers: str, result: str) -> None:
        rows.append(f"| {claim} | {compared} | {numbers} | {result} |")

    def missing(names) -> List[str]:
        return [n for n in names if not runs.get(n)]

    def difference(claim: str, a: str, b: str, metric, claimed_sign: int, no_worse: bool = False) -> None:
        if missing((a, b)):
            row(claim, f"{a} − {b}", "not run yet: " + ", ".join(missing((a, b))), "inconclusive (0/3 seeds)")
            return
        pd = targets.paired(per_seed(runs, a, metric), per_seed(runs, b, metric))
        row(claim, f"{a} − {b}", targets.fmt(pd), verdict(pd, claimed_sign, no_worse))

    def single(claim: str, name: str, metric, claimed_sign: int, unit: str = "") -> None:
        if missing((name,)):
            row(claim, name, "not run yet", "inconclusive (0/3 seeds)")
            return
        pd = one_sample(per_seed(runs, name, metric))
        row(claim, name, targets.fmt(pd) + unit, verdict(pd, claimed_sign))

    # 1. stable training: every seed of every fixed-capacity variant ends below where it began
    lm_start = curve_mean("loss/lm", slice(None, FIRST_STEPS))
    lm_end = curve_mean("loss/lm", slice(-LAST_STEPS, None))
    for name in (role[r] for r in FIXED_CAPACITY):
        if missing((name,)):
            row("1 · Fig. 2A: trains stably", name, "not run yet", "inconclusive (0/3 seeds)")
            continue
        ends = [(lm_start(r), lm_end(r)) for r in runs[name]]
        stable = [s is not None and e is not None and math.isfinite(e) and e < s for s, e in ends]
        numbers = ", ".join(f"{s:.2f} → {e:.2f}" if s is not None and e is not None else "no curve" for s, e in ends)
        if not all(stable):
            result = "not reproduced"
        elif len(ends) < SEEDS_NEEDED:
            result = f"inconclusive ({len(ends)}/{SEEDS_NEEDED} seeds)"
        else:
            result = "reproduced"
        row("1 · Fig. 2A: trains stably", name, f"training LM loss first {FIRST_STEPS} → last {LAST_STEPS} steps: "
            + numbers, result)
    dynamic, sdt, stt, mod = role["dynamic"], role["sdt"], role["stt"], role["mod"]
    if not missing((dynamic,)):
        executed_start = teacher_fraction_mean(slice(None, FIRST_STEPS))
        executed_end = teacher_fraction_mean(slice(-LAST_STEPS, None))

        def pair(start, end):
            return f"{start:.2f} → {end:.2f}" if start is not None and end is not None else "no curve"
        row("1 · Fig. 2A (dynamic capacity, not in the figure)", dynamic,
            f"training LM loss first {FIRST_STEPS} → last {LAST_STEPS} steps: "
            + ", ".join(pair(lm_start(r), lm_end(r)) for r in runs[dynamic])
            + "; teacher's executed fraction: "
            + ", ".join(pair(executed_start(r), executed_end(r)) for r in runs[dynamic]),
            "no verdict: its compute falls while it trains")
    # 2. comparable training rate: surprise routing's final training loss is not above MoD's
    for name in (sdt, stt):
        difference("2 · Fig. 2A: surprise trains as well as MoD", name, mod, lm_end, -1, no_worse=True)
    # 3. the temporal prior predicts better than the spatial one, whatever its size
    for prior in (sdt, role["larger_prior"]):
        difference("3 · Fig. 2B: TPN (STT) predicts better than PriorFFN (SDT), held-out D_ch/D_st", stt, prior,
                   unexplained_share, -1)
    # 4. dynamic capacity falls with depth
    single("4 · Fig. 2C: dynamic capacity falls with depth", dynamic, depth_slope, -1, " per layer")
    # 5. novelty first, prediction later
    shifters = [sdt, stt] + sorted(n for n, rs in runs.items() if rs[0].get("variant") in ("sdt", "stt")
                                   and n not in (sdt, stt))
    for name in shifters:
        claim = "5 · §5: CU first, CE later" + ("" if name in (sdt, stt) else " (other recipes)")
        single(claim, name, ce_over_cu_shift, +1, " (CE − CU share, late − early)")
    # 6. causal-router agreement, STT vs SDT (answered either way)
    if missing((stt, sdt)):
        row("6 · router agreement, STT vs SDT", f"{stt} − {sdt}",
            "not run yet: " + ", ".join(missing((stt, sdt))), "inconclusive (0/3 seeds)")
    else:
        pd = targets.paired(per_seed(runs, stt, mean_agreement), per_seed(runs, sdt, mean_agreement))
        row("6 · router agreement, STT vs SDT", f"{stt} − {sdt} (held-out accuracy)", targets.fmt(pd),
            targets.which_wins(pd, below="SDT's causal router agrees more", above="STT's causal router agrees more",
                               pending="inconclusive"))
    # 7. a lightweight prior is sufficient: the larger one does not lower the student's loss
    difference("7 · Table 2: lightweight PriorFFN suffices", role["larger_prior"], sdt, heldout_student_loss,
               +1, no_worse=True)
    # 8. full fine-tuning beats LoRA
    difference("8 · Table 2: full fine-tuning beats LoRA", role["lora"], stt, heldout_student_loss, +1)
    # 9. every conditional-compute variant underperforms dense
    for name in (role[r] for r in PAPER_VARIANTS):
        difference("9 · Table 1: below dense", name, role["dense"], heldout_student_loss, +1)
    header = ["| claim | runs | numbers (mean ± se over seeds) | verdict |", "|---|---|---|---|"]
    return "\n".join(header + rows)


def main() -> str:
    return targets.print_or_write(__doc__.split("\n\n")[0], claims_table, "claims.md",
                                  "The papers' claims on the runs so far",
                                  "criteria in its docstring, plots in [README.md](README.md#the-papers-claims).")


if __name__ == "__main__":
    main()
