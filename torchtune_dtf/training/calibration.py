"""Hold a threshold student to its budget: calibrate each causal router's bias after training.

A threshold student runs token t at a routed layer when its causal router says σ(r̃_t) > τ. Nothing in
training ties how often that happens to the layer's capacity: the router is trained by BCE against the
teacher's mask, and after a capacity curriculum (teacher γ' near 1 for many steps) or with a drifting teacher
it can learn "select almost everything" — a student at 96 % executed is not the 0.81-of-dense-FLOPs model
its config describes. Every FLOP, KV and quality number of a routed model is only meaningful at the budget it
actually runs.

The causal router ends in ``Linear(h → 1)``, so adding δ to that one bias shifts every logit by δ and keeps
the ranking. With q the (1 − f)-quantile of a layer's logits on calibration text, δ = logit(τ) − q makes a
fraction f pass: the target f of a layer is what its teacher executes on the same text (exactly γ for top-k
teachers; the learned average for the dynamic-capacity STT). Routed layers are coupled (a layer's selection
changes every later layer's input), so the shift is repeated for a few full student forwards. Only a parameter
value changes: the code path evaluated and deployed is the ordinary student.
"""

from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_dtf.modules.layers import RoutedSelfAttentionLayer
from torchtune_dtf.modules.routing_context import RoutingContext

#: One calibration batch: ``tokens [b, s]``, optional ``mask``/``input_pos`` (packed data) and optional
#: ``valid [b, s]`` (real tokens, not padding; every token when absent).
CalibrationBatch = Mapping[str, torch.Tensor]


def calibratable_layers(model: nn.Module) -> List[RoutedSelfAttentionLayer]:
    """Routed layers whose student is a causal router compared against a threshold."""
    return [
        layer for layer in model.layers
        if isinstance(layer, RoutedSelfAttentionLayer) and layer.causal_router is not None
        and layer.student_routing_mode == "threshold"
    ]


def _forward(model: nn.Module, batch: CalibrationBatch, routing: RoutingContext) -> None:
    model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"), routing=routing)


def _valid(batch: CalibrationBatch, like: torch.Tensor) -> torch.Tensor:
    valid = batch.get("valid")
    return torch.ones_like(like, dtype=torch.bool) if valid is None else valid.to(like.device)


@torch.no_grad()
def teacher_fractions(model: nn.Module, batches: Sequence[CalibrationBatch], routing: RoutingContext) -> Dict[int, float]:
    """Fraction of real tokens each calibratable layer's teacher selects on ``batches``.

    Args:
        routing (RoutingContext): a teacher-mode context (its β and capacity progress); a fresh copy per batch.
    """
    layers = calibratable_layers(model)
    selected = {layer.layer_idx: 0.0 for layer in layers}
    total = 0.0
    for batch in batches:
        ctx = RoutingContext(mode="teacher", beta_ce=routing.beta_ce, beta_cu=routing.beta_cu,
                             capacity_progress=routing.capacity_progress)
        _forward(model, batch, ctx)
        valid = _valid(batch, batch["tokens"])
        total += float(valid.sum())
        for idx in selected:
            selected[idx] += float((ctx.layers[idx].teacher_mask & valid).sum())
    return {idx: count / total for idx, count in selected.items()}


@torch.no_grad()
def student_fractions(model: nn.Module, batches: Sequence[CalibrationBatch]) -> Dict[int, float]:
    """Fraction of real tokens each calibratable layer's student executes on ``batches``."""
    fractions, _ = _student_pass(model, batches)
    return fractions


def _student_pass(model: nn.Module, batches: Sequence[CalibrationBatch]):
    layers = calibratable_layers(model)
    logits: Dict[int, List[torch.Tensor]] = {layer.layer_idx: [] for layer in layers}
    selected = {layer.layer_idx: 0.0 for layer in layers}
    total = 0.0
    for batch in batches:
        ctx = RoutingContext(mode="student")
        _forward(model, batch, ctx)
        valid = _valid(batch, batch["tokens"])
        total += float(valid.sum())
        for idx in logits:
            record = ctx.layers[idx]
            logits[idx].append(record.student_logits.float()[valid])
            selected[idx] += float((record.selected_mask & valid).sum())
    return {idx: count / total for idx, count in selected.items()}, {idx: torch.cat(v) for idx, v in logits.items()}


@torch.no_grad()
def calibrate_student_routers(
    model: nn.Module, batches: Sequence[CalibrationBatch], targets: Mapping[int, float], rounds: int
) -> Dict[int, float]:
    """Shift each calibratable layer's causal-router output bias so that its student executes the fraction
    ``targets[layer_idx]`` of the real tokens in ``batches``.

    Args:
        model: a routed decoder (plain or FSDP2-sharded: the shift is a scalar added in place, so a sharded
            bias takes it on whichever rank holds it; every rank must pass the same ``batches``).
        batches: calibration text (see :data:`CalibrationBatch`).
        targets: executed fraction per layer index, in [0, 1].
        rounds (int): student forwards that each re-estimate every layer's quantile (≥ 1; layers are coupled).

    Returns:
        Dict[int, float]: the executed fraction per layer after calibration, measured on ``batches``.
    """
    if rounds < 1:
        raise ValueError(f"Calibration needs at least one round, got rounds={rounds}")
    layers = {layer.layer_idx: layer for layer in calibratable_layers(model)}
    if set(targets) != set(layers):
        raise ValueError(f"Calibration targets name layers {sorted(targets)}, the model's threshold students are {sorted(layers)}")
    for idx, fraction in targets.items():
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"Calibration target of layer {idx} must be in [0, 1], got {fraction}")
    for _ in range(rounds):
        _, logits = _student_pass(model, batches)
        for idx, layer in layers.items():
            threshold_logit = layer.student_logit_threshold  # logit(τ): the student runs r̃ > this
            if threshold_logit == float("-inf"):
                raise ValueError(f"Layer {idx}: student_threshold 0 runs every token; there is no threshold to calibrate")
            # The (1 − f)-quantile q passes the tokens above it; at f = 0 or 1 push past the extremes.
            layer_logits = logits[idx]
            fraction = targets[idx]
            if fraction <= 0.0:
                q = float(layer_logits.max()) + 1.0
            elif fraction >= 1.0:
                q = float(layer_logits.min()) - 1.0
            else:
                q = float(torch.quantile(layer_logits, 1.0 - fraction))
            layer.causal_router.out.bias.add_(threshold_logit - q)
    return student_fractions(model, batches)


def calibrate_to_teacher(
    model: nn.Module, batches: Sequence[CalibrationBatch], teacher_routing: RoutingContext, rounds: int
) -> Dict[int, Dict[str, float]]:
    """:func:`calibrate_student_routers` with each layer's target = its teacher's executed fraction on
    ``batches``. Returns ``{layer_idx: {"target", "before", "after"}}``."""
    was_training = model.training
    model.eval()
    try:
        targets = teacher_fractions(model, batches, teacher_routing)
        before = student_fractions(model, batches)
        after = calibrate_student_routers(model, batches, targets, rounds)
    finally:
        model.train(was_training)
    return {idx: {"target": targets[idx], "before": before[idx], "after": after[idx]} for idx in targets}


def batch_for_calibration(batch: Mapping[str, torch.Tensor], ignore_index: int) -> Dict[str, Optional[torch.Tensor]]:
    """A collated training batch as a :data:`CalibrationBatch`: real tokens are those with a label."""
    return {
        "tokens": batch["tokens"],
        "mask": batch.get("mask"),
        "input_pos": batch.get("input_pos"),
        "valid": batch["labels"] != ignore_index,
    }
