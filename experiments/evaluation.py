"""What a finished training is scored on, in the driver's process: the held-out (validation) windows, the test
windows once, the closed-form compute at the measured executed fractions, and the training log's curves."""

import math
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional


def heldout_evaluation(saved_config: Path, checkpoint_dir: Path, heldout: Dict[str, Any],
                       test: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Student and teacher held-out loss and per-layer routing report of a trained run (in this process); with
    ``test``, also the deployed (student) loss of each test window (the test set is scored once, at the end, and
    runs are compared on it window by window) and the seconds that took (``test_seconds``)."""
    from omegaconf import OmegaConf
    from torchtune import config

    from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext
    from torchtune_dtf.evaluation.routing_report import heldout_loss, heldout_windows, load_trained, routed_passes
    from torchtune_dtf.evaluation.side_by_side import window_losses

    cfg = OmegaConf.load(saved_config)
    tokenizer = config.instantiate(cfg.tokenizer)
    windows = heldout_windows(tokenizer, Path(heldout["file"]), int(heldout["seq_len"]), int(heldout["windows"]))
    model = load_trained(cfg, checkpoint_dir)
    batch_size = int(heldout.get("batch_size", 4))
    routed = any(isinstance(m, RoutedSelfAttentionLayer) for m in model.modules())
    beta = cfg.get("beta_schedule")
    beta_ce = float(beta.beta_ce_end) if beta is not None else None
    beta_cu = float(beta.beta_cu_end) if beta is not None else None
    out: Dict[str, Any] = {
        "file": heldout["file"], "windows": int(heldout["windows"]), "seq_len": int(heldout["seq_len"]),
        "tokens": int(windows[:, 1:].numel()),
        "student_loss": None, "teacher_loss": None, "teacher_beta": None,
    }
    layers: Dict[int, Dict[str, float]] = {}
    if routed:  # one student and one teacher pass give the losses and the per-layer report
        layers, student_losses, teacher_losses = routed_passes(model, windows, beta_ce, beta_cu, batch_size)
        out["student_loss"], out["teacher_loss"] = float(student_losses.mean()), float(teacher_losses.mean())
        out["teacher_beta"] = {"ce": beta_ce, "cu": beta_cu}
    else:
        out["student_loss"] = heldout_loss(model, windows, None, batch_size)
    result = {"heldout": out, "layers": {str(k): v for k, v in layers.items()}}
    if test:
        start = time.perf_counter()
        test_windows = heldout_windows(tokenizer, Path(test["file"]), int(test["seq_len"]), int(test["windows"]),
                                       spread=bool(test["spread"]))
        losses = window_losses(model, test_windows, (lambda: RoutingContext(mode="student")) if routed else None,
                               int(test.get("batch_size", 4)))
        result["test"] = {"file": test["file"], "windows": int(test["windows"]), "seq_len": int(test["seq_len"]),
                          "placement": "spread" if test["spread"] else "first",
                          "tokens": int(test_windows[:, 1:].numel()), "student_loss": float(losses.mean()),
                          "window_losses": [round(float(v), 6) for v in losses]}
        result["test_seconds"] = time.perf_counter() - start
    del model
    return result


def compute_summary(saved: Dict[str, Any], executed: Dict[int, float], seq_len: int) -> Dict[str, Any]:
    """Closed-form forward FLOPs and KV bytes per token of the deployed model at ``seq_len`` (``per_token_compute``),
    with the executed fraction per routed layer as measured; also its variant and distillation weight."""
    from torchtune_dtf import closed_form as cf

    model = saved["model"]
    shape = cf.model_shape_from_config(model)
    rshape = cf.routing_shape_from_model_config(model, shape.num_layers, shape.embed_dim)
    dtype = str(saved.get("dtype", "fp32"))
    bytes_per_value = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype, 4)
    distillation = saved.get("distillation") or {}
    weight = float(distillation.get("weight", 0.0) or 0.0)
    train_seq_len = (saved.get("tokenizer") or {}).get("max_seq_len")
    out = cf.per_token_compute(shape, rshape, seq_len, executed, bytes_per_value=bytes_per_value,
                               distillation_weight=weight, distillation_seq_len=train_seq_len or seq_len)
    out["variant"] = rshape.variant
    out["distillation_weight"] = weight
    return out


# (the DiskLogger files are read by torchtune_dtf.evaluation.metric_logs.parse_disk_logs, shared with routing_plots)
def _round(value: float, digits: int = 6) -> Optional[float]:
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{digits}g}")


def curves_from_log(rows: Dict[int, Dict[str, float]]) -> Dict[str, Any]:
    """``{steps, series: {key: [value or None per step]}}`` of every key the training log holds (6 digits)."""
    steps = sorted(rows)
    keys = sorted({k for row in rows.values() for k in row})
    return {"steps": steps, "series": {k: [_round(rows[s][k]) if k in rows[s] else None for s in steps] for k in keys}}


def routing_stats(rows: Dict[int, Dict[str, float]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Per routed layer and logged routing metric: mean over the training steps, first and last value."""
    series: Dict[str, Dict[str, List[float]]] = {}
    for step in sorted(rows):
        for key, value in rows[step].items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "routing" and math.isfinite(value):
                series.setdefault(parts[1], {}).setdefault(parts[2], []).append(value)
    return {
        layer: {name: {"mean": statistics.fmean(v), "first": v[0], "last": v[-1]} for name, v in sorted(metrics.items())}
        for layer, metrics in sorted(series.items(), key=lambda kv: int(kv[0].split("_")[-1]))
    }
