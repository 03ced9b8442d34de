"""The run JSONs of a study read back: every result by run name, the tables' columns, and the training curves and
held-out per-layer values the plots and the claims are drawn from; and, for a page that shows runs before they
finish, the curves of the runs still training read from their logs (:func:`in_training_results`)."""

import json
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

#: The variants that route tokens (one list: the driver's pages, targets.py and claims.py read it).
ROUTED_VARIANTS = ("mod", "sdt", "stt")

Results = Dict[str, List[Dict[str, Any]]]


def load_results(out_dir: Path) -> Tuple[Dict[str, Any], Results]:
    """``(study.json or {}, {run name: [result, ...] by seed})`` of the run JSONs in ``out_dir/runs``."""
    out_dir = Path(out_dir)
    spec_path = out_dir / "study.json"
    spec = json.loads(spec_path.read_text()) if spec_path.is_file() else {}
    runs: Results = {}
    for path in sorted((out_dir / "runs").glob("*.json")):
        result = json.loads(path.read_text())
        runs.setdefault(result["name"], []).append(result)
    for results in runs.values():
        results.sort(key=lambda r: r["seed"])
    return spec, runs


def field(*keys: str) -> Callable[[Dict[str, Any]], Optional[float]]:
    """A run JSON's number at the nested ``keys`` (None where any level is missing or null)."""
    def value(result):
        for key in keys:
            if not isinstance(result, dict) or result.get(key) is None:
                return None
            result = result[key]
        return float(result)
    return value


#: The runs table's columns: (header, value of one run JSON, digits).
METRICS = [
    ("fwd FLOPs ratio", field("compute", "forward_flops_ratio"), 3),
    ("KV bytes ratio", field("compute", "kv_bytes_ratio"), 3),
    ("student loss", field("heldout", "student_loss"), 3),
    ("teacher loss", field("heldout", "teacher_loss"), 3),
    ("MC acc", field("eleuther", "mc_acc"), 3),
    ("executed", field("executed_fraction_mean"), 3),
    ("train s", field("wall_time_s", "train"), 0),
    ("eval s", field("wall_time_s", "eval"), 0),
]
METRIC = {header: fn for header, fn, _ in METRICS}


def model_config(result: Dict[str, Any]) -> Dict[str, Any]:
    """The ``model`` section of the config a run trained with ({} when the JSON has none)."""
    return (result.get("config") or {}).get("model") or {}


def series_by_step(result: Dict[str, Any], key: str) -> Dict[int, float]:
    """One run JSON's training-log series ``key`` as ``{step: value}`` (logged steps only)."""
    curves = result.get("curves") or {}
    values = (curves.get("series") or {}).get(key) or []
    return {step: value for step, value in zip(curves.get("steps") or [], values) if value is not None}


def mean_curve(results: List[Dict[str, Any]], key: str) -> Tuple[List[int], List[float]]:
    """Per logged step, the mean over seeds of the training-log series ``key``."""
    by_step: Dict[int, List[float]] = {}
    for r in results:
        for step, value in series_by_step(r, key).items():
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def paired_curve_difference(results: List[Dict[str, Any]], baseline: List[Dict[str, Any]],
                            key: str) -> Tuple[List[int], List[float], List[int]]:
    """Per step that a run and a baseline both logged ``key`` on the same seed: the mean over those seeds of
    run − baseline, and how many seeds it averages (``(steps, differences, seeds)``). Paired by seed, as the
    tables are, so a step's difference compares the same data order and initialisation."""
    base_by_seed = {r["seed"]: series_by_step(r, key) for r in baseline}
    by_step: Dict[int, List[float]] = {}
    for r in results:
        base = base_by_seed.get(r["seed"])
        if base is None:
            continue
        for step, value in series_by_step(r, key).items():
            if step in base:
                by_step.setdefault(step, []).append(value - base[step])
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps], [len(by_step[s]) for s in steps]


def layer_mean_curve(results: List[Dict[str, Any]], metric: str,
                     divided_by: Optional[str] = None) -> Tuple[List[int], List[float]]:
    """Per step, the mean over routed layers (then over seeds) of ``routing/layer_i/<metric>``, or of its ratio
    to ``routing/layer_i/<divided_by>`` per layer (a scale-free mean when layers differ in scale)."""
    by_step: Dict[int, List[float]] = {}
    for r in results:
        series = (r.get("curves") or {}).get("series") or {}
        keys = [k for k in series if k.startswith("routing/layer_") and k.endswith("/" + metric)]
        for i, step in enumerate((r.get("curves") or {}).get("steps") or []):
            if divided_by is None:
                values = [series[k][i] for k in keys if series[k][i] is not None]
            else:
                pairs = [(series[k][i], (series.get(k[: -len(metric)] + divided_by) or [None] * (i + 1))[i]) for k in keys]
                values = [num / den for num, den in pairs if num is not None and den]
            if values:
                by_step.setdefault(step, []).append(statistics.fmean(values))
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def layer_values(results: List[Dict[str, Any]], key: str) -> Dict[int, float]:
    """Per layer, the mean over seeds of ``layers[l][key]`` (held-out report)."""
    per: Dict[int, List[float]] = {}
    for r in results:
        for layer, row in (r.get("layers") or {}).items():
            if key in row:
                per.setdefault(int(layer), []).append(row[key])
    return {layer: statistics.fmean(v) for layer, v in sorted(per.items())}


def unexplained_update_share(results: List[Dict[str, Any]]) -> Optional[float]:
    """Mean over routed layers of held-out D_ch / D_st: the share of the block's update (its squared norm) that
    the PriorFFN/TPN leaves unexplained (1 = it predicts nothing, 0 = exactly). Scale-free per layer, unlike
    ``loss/pred``, the raw MSE averaged over layers, which one layer with massive activations decides (in
    SmolLM2-135M layer 11's update has D_st ≈ 2,000–4,000 against ≤ 35 elsewhere, ~99 % of the mean)."""
    change, static = layer_values(results, "teacher/d_ch"), layer_values(results, "teacher/d_st")
    ratios = [change[layer] / static[layer] for layer in change if static.get(layer)]
    return statistics.fmean(ratios) if ratios else None


def in_training_results(spec: Dict[str, Any], finished: Results) -> Results:
    """The study's (run, seed)s that have no result JSON yet but whose training has logged steps: ``{name:
    [partial result, ...]}`` with ``name``, ``seed``, ``steps`` (the last step logged), ``planned_steps`` and the
    ``curves`` read from the run's training logs in ``spec["work_dir"]`` (the same reading the driver does when
    the run finishes), so a long study's page can show how far its running runs have come. Nothing here is a
    result: the logs belong to this machine and the runs are unscored."""
    from torchtune_dtf.evaluation.metric_logs import parse_disk_logs

    from experiments.evaluation import curves_from_log
    from experiments.spec import run_id
    from experiments.training import planned_steps

    partial: Results = {}
    work_dir = spec.get("work_dir")
    if not work_dir:
        return partial
    for run in spec.get("runs", []):
        done = {r["seed"] for r in finished.get(run["name"], [])}
        for seed in spec.get("seeds", []):
            logs = Path(work_dir) / "runs" / run_id(run["name"], int(seed)) / "logs"
            if int(seed) in done or not logs.is_dir():
                continue
            rows = parse_disk_logs(logs)
            trained = [step for step, row in rows.items() if "loss/lm" in row]
            if not trained:
                continue
            partial.setdefault(run["name"], []).append({
                "name": run["name"], "seed": int(seed), "steps": max(trained),
                "planned_steps": planned_steps(run["config"], spec.get("budget") or {}, run["overrides"])
                if Path(run["config"]).is_file() else None,
                "curves": curves_from_log(rows)})
    return partial
