"""The summary ``routed_finetune`` logs once, after its final checkpoint: steps, tokens, wall time and
throughput, the last train and validation losses, the student's executed fraction per routed layer with the
model as saved (after student calibration), and where the output is.

It goes to the console (``Run summary:``) and to the metric log as ``summary/...`` at the last step
(docs/checkpoints.md, "What a training run prints").
"""

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtune import utils

from torchtune_dtf.modules.layers import RoutedSelfAttentionLayer
from torchtune_dtf.modules.routing_context import RoutingContext
from torchtune_dtf.training.calibration import batch_for_calibration, executed_fractions

log = utils.get_logger("INFO")


@torch.no_grad()
def student_executed_fractions(
    model: nn.Module,
    train_loader: StatefulDataLoader,
    val_loader: Optional[StatefulDataLoader],
    ignore_index: int,
    device: torch.device,
    all_reduce: bool,
) -> Tuple[str, Dict[int, float]]:
    """``(source, {layer: fraction})``: the share of real tokens each routed layer's student runs on the first
    batch of the validation data (of the training data without ``val_loader``). One no-grad student forward in
    eval mode; with ``all_reduce`` on every rank (FSDP2 forwards are collective), the counts summed over ranks.

    ``source`` says which batch was counted, or why there are no fractions (``""`` for a model without routed
    layers, a sentence for a whole-sequence top-k student)."""
    layers = [m for m in model.modules() if isinstance(m, RoutedSelfAttentionLayer)]
    if not layers:
        return "", {}
    if any(m.student_routing_mode == "topk" and not m.allow_noncausal_student_topk for m in layers):
        # A whole-sequence top-k student is refused without a cache (docs/design.md R4); it runs ⌊γ·n⌋ by construction.
        return "top-k student: ⌊γ·n⌋ per sequence by construction", {}
    loader, source = (val_loader, "validation") if val_loader is not None else (train_loader, "training")
    # From the dataset, not an iterator of the loader: the training loader's position stays what it saved.
    rows = [loader.dataset[i] for i in range(min(loader.batch_size, len(loader.dataset)))]
    batch = batch_for_calibration(loader.collate_fn(rows), ignore_index)
    batch = {k: (v.to(device) if v is not None else None) for k, v in batch.items()}
    model.eval()
    try:
        fractions = executed_fractions(model, [batch], lambda: RoutingContext(mode="student"), all_reduce=all_reduce)
    finally:
        model.train()
    return f"first {source} batch", fractions


def summarize_run(
    *,
    steps: int,
    global_step: int,
    total_steps: int,
    tokens: int,
    wall_s: float,
    last_lm_loss: Optional[float],
    last_validation: Optional[Tuple[int, Dict[str, float]]],
    has_validation_data: bool,
    val_every_n_steps: int,
    calibrated: bool,
    executed_source: str,
    executed: Dict[int, float],
    output_dir: str,
    metric_logger: Any,
) -> Dict[str, Any]:
    """Log the run summary and write it to ``metric_logger`` as ``summary/...`` at ``global_step`` (rank 0 only).

    Args:
        steps (int): optimizer steps this invocation ran (a resumed run counts from where it resumed).
        global_step (int): the step the run ended at, of ``total_steps``.
        tokens (int): target tokens this invocation trained on, over all ranks.
        wall_s (float): this invocation's wall time.
        last_lm_loss (Optional[float]): the LM loss of the last step (``None`` when no step ran).
        last_validation (Optional[Tuple[int, Dict[str, float]]]): ``(step, metrics)`` of the last validation,
            metrics ``val/lm_loss_student`` and ``val/lm_loss_teacher``; ``None`` when none ran.
        has_validation_data (bool), val_every_n_steps (int): why no validation ran, when none did.
        calibrated (bool): student calibration ran after the last validation (the losses precede it).
        executed_source (str), executed (Dict[int, float]): :func:`student_executed_fractions`.
        output_dir (str): the folder of the final checkpoint.

    Returns:
        Dict[str, Any]: the summary (steps, tokens, wall time, throughput, losses, executed fractions, output).
    """
    val_step, val = last_validation if last_validation is not None else (None, {})
    summary: Dict[str, Any] = {
        "steps": steps, "global_step": global_step, "total_steps": total_steps, "tokens": tokens,
        "wall_s": wall_s, "tokens_per_second": tokens / max(wall_s, 1e-9), "train_lm_loss": last_lm_loss,
        "val_step": val_step, "val_lm_loss_student": val.get("val/lm_loss_student"),
        "val_lm_loss_teacher": val.get("val/lm_loss_teacher"), "executed_source": executed_source,
        "executed_fraction": executed,
        "output_dir": output_dir,
        # DiskLogger's file; other loggers (stdout, W&B, TensorBoard) have none.
        "metric_log": str(metric_logger.path_to_log_file()) if hasattr(metric_logger, "path_to_log_file") else None,
    }
    first = global_step - steps + 1
    lines = [
        f"steps {first}–{global_step} of {total_steps} ({steps} in this run), {tokens:,} target tokens, "
        f"{wall_s:.1f} s wall time, {summary['tokens_per_second']:.1f} tokens/s",
        "train LM loss, last step: " + (f"{last_lm_loss:.4f}" if last_lm_loss is not None else "– (no step run)"),
    ]
    if val_step is None:
        why = "no dataset_val" if not has_validation_data else f"validation.every_n_steps is {val_every_n_steps}"
        lines.append(f"validation: none ran ({why})")
    else:
        after = " (before student calibration)" if calibrated else ""
        lines.append(f"validation LM loss at step {val_step}{after}: student {val['val/lm_loss_student']:.4f}, "
                     f"teacher {val['val/lm_loss_teacher']:.4f}")
    if executed:
        lines.append(f"student executes ({executed_source}, model as saved): "
                     + ", ".join(f"layer {i} {f:.3f}" for i, f in executed.items()))
    elif executed_source:
        lines.append(f"student executes: {executed_source}")
    lines.append(f"output: {summary['output_dir']}" + (f"  (metrics: {summary['metric_log']})" if summary["metric_log"] else ""))
    log.info("Run summary:\n  " + "\n  ".join(lines))

    numeric = {k: summary[k] for k in ("steps", "tokens", "wall_s", "tokens_per_second", "train_lm_loss",
                                       "val_lm_loss_student", "val_lm_loss_teacher") if summary[k] is not None}
    numeric.update({f"layer_{i}/student_executed": f for i, f in executed.items()})
    metric_logger.log_dict({f"summary/{k}": v for k, v in numeric.items()}, step=global_step)
    return summary
