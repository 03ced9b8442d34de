"""The statistics of the study pages: per-seed paired differences with Student's t interval, the two-level
(seed × window) bootstrap of the test set, and the small reductions the tables and plots share.

Quantiles come from ``scipy.stats`` distributions. The t quantile is rounded to three decimals, as printed tables
give it: the pages written before this module (from such a table) re-aggregate to the same bytes, and the rounding
moves an interval's bound by less than 5e-4 standard errors. (That table stopped at 30 degrees of freedom and
used the normal 1.96 beyond; a study of 32 seeds or more now gets the t quantile there too.)
"""

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from scipy import stats as distributions


def t_quantile(dof: int, level: float = 0.95, digits: Optional[int] = 3) -> float:
    """The two-sided ``level`` quantile of Student's t with ``dof`` degrees of freedom, t_{(1 + level)/2, dof}
    (12.706 at 1 dof, 4.303 at 2, 2.042 at 30), rounded to ``digits`` (None: not rounded)."""
    if dof < 1:
        raise ValueError(f"Student's t needs at least one degree of freedom, got {dof}")
    value = float(distributions.t.ppf((1 + level) / 2, dof))
    return value if digits is None else round(value, digits)


def paired_difference(diffs: Sequence[float]) -> Dict[str, Any]:
    """Mean, standard deviation, standard error and 95 % t-interval (n − 1 dof) of per-seed differences."""
    n = len(diffs)
    mean = statistics.fmean(diffs) if n else None
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "se": None, "ci95": None}
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = t_quantile(n - 1) * se
    return {"n": n, "mean": mean, "sd": sd, "se": se, "ci95": (mean - half, mean + half)}


def seed_window_bootstrap(pairs: Sequence[Tuple[Sequence[float], Sequence[float]]], *, resamples: int, seed: int,
                          level: float = 0.95) -> Dict[str, Any]:
    """Mean of run − baseline over seeds and test windows, with a percentile interval from a two-level bootstrap:
    each resample draws seeds with replacement (a run paired with its baseline of the same seed) and windows with
    replacement (the same windows for both, as every run reads the same test windows), so the interval covers text
    sampling as well as training noise. ``pairs``: per seed, (run's window losses, baseline's window losses)."""
    import numpy as np

    lengths = sorted({len(losses) for pair in pairs for losses in pair})
    if not pairs or len(lengths) != 1 or lengths[0] == 0:
        raise ValueError(f"pairs must hold per-window losses of one length for every seed, got lengths {lengths}")
    diffs = np.array([np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64) for a, b in pairs])
    rng = np.random.default_rng(seed)
    n_seeds, n_windows = diffs.shape
    seeds = rng.integers(0, n_seeds, size=(resamples, n_seeds))
    windows = rng.integers(0, n_windows, size=(resamples, n_windows))
    means = diffs[seeds[:, :, None], windows[:, None, :]].mean(axis=(1, 2))
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return {"n_seeds": n_seeds, "windows": n_windows, "mean": float(diffs.mean()), "interval": (float(lo), float(hi)),
            "resamples": resamples}


def finite(values: Sequence[Optional[float]]) -> List[float]:
    """The values that are numbers and finite (a run without a metric gives None)."""
    return [v for v in values if v is not None and math.isfinite(v)]


def mean_std(values: Sequence[Optional[float]]) -> Tuple[Optional[float], float]:
    """Mean and sample standard deviation of the finite values (None, 0 without any; std 0 with one)."""
    values = finite(values)
    if not values:
        return None, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def slope(xs: List[float], ys: List[float]) -> Optional[float]:
    """Least-squares slope of ys against xs (None for fewer than two points or a constant x)."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return None if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def lowest_at_equal_flops(points: Sequence[Tuple[float, float]], digits: Optional[int] = None) -> List[Tuple[float, float]]:
    """(FLOPs ratio, loss) points → one point per FLOPs, the lowest loss there, sorted by FLOPs.

    A baseline family can hold several models at the same compute (layer dropping trained with and without
    distillation); its line goes through the stronger one. ``digits`` rounds the FLOPs before they are compared
    (for means over seeds); None compares them exactly (one seed's runs, where the twins' FLOPs are equal)."""
    lowest: Dict[float, float] = {}
    for flops, loss in points:
        key = flops if digits is None else round(flops, digits)
        lowest[key] = min(loss, lowest.get(key, loss))
    return sorted(lowest.items())


def line_at(points: Sequence[Tuple[float, Sequence[float]]], flops: float) -> Optional[List[float]]:
    """A baseline line's per-window losses at ``flops``: ``points`` are its runs at one seed as (FLOPs ratio, the
    losses of the same windows), e.g. layer dropping 7 and 8. Linear in FLOPs between the two runs that bracket
    ``flops``, window by window; the cheapest run's losses below them all (a candidate cheaper than every run of the
    line is measured against that run, which spends more); None above them all (the line says nothing there). Runs
    at the same FLOPs (the same dropped layers with and without distillation) give the line the lower mean loss:
    the stronger baseline there."""
    strongest: Dict[float, List[float]] = {}
    for x, losses in points:
        losses = [float(v) for v in losses]
        if x not in strongest or statistics.fmean(losses) < statistics.fmean(strongest[x]):
            strongest[x] = losses
    line = sorted(strongest.items())
    if not line:
        return None
    if flops <= line[0][0]:
        return line[0][1]
    for (x0, y0), (x1, y1) in zip(line, line[1:]):
        if x0 <= flops <= x1:
            w = (flops - x0) / (x1 - x0)
            return [a + w * (b - a) for a, b in zip(y0, y1)]
    return None
