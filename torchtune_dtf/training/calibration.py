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
teachers; the learned average for the dynamic-capacity STT). Only a parameter value changes: the code path
evaluated and deployed is the ordinary student.

Routed layers are coupled: a layer's selection changes every later layer's input, and so its logits. Shifting
every layer at once from one forward (a Jacobi step) fixes one more layer per round: after a capacity
curriculum the students start near 100 % executed, and three such rounds left the 4th to 14th routed layers of
SmolLM2-135M at 0.48 down to 0.13 of their 0.5 target. So the first round goes in depth order (a Gauss–Seidel
step): while its forwards run, a hook holds every layer to its target on that batch (that batch's quantile), so a
deeper layer's logits are measured under the selections the calibrated upstream layers will make; after the pass
each bias takes the quantile over all batches. That round is exact but for the spread of per-batch quantiles
upstream; the later rounds are plain ones (every layer re-measured from one ordinary student pass), which remove
that small rest.
"""

import math
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
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


def _routed_passes(
    model: nn.Module, batches: Sequence[CalibrationBatch], routing: Callable[[], RoutingContext]
) -> Iterator[Tuple[RoutingContext, torch.Tensor]]:
    """One forward per batch, each with a fresh context from ``routing()``; yields that context (holding each
    routed layer's record of the forward) and the batch's real tokens ``valid [b, s]``."""
    for batch in batches:
        ctx = routing()
        _forward(model, batch, ctx)
        yield ctx, _valid(batch, batch["tokens"])


@torch.no_grad()
def executed_fractions(
    model: nn.Module,
    batches: Sequence[CalibrationBatch],
    routing: Callable[[], RoutingContext],
    layers: Optional[Sequence[int]] = None,
    selection: str = "selected_mask",
    all_reduce: bool = False,
) -> Dict[int, float]:
    """Fraction of the real tokens of ``batches`` that each routed layer runs: Σ (selection & valid) / Σ valid.

    Args:
        model: a routed decoder (plain or FSDP2-sharded).
        batches: the text (see :data:`CalibrationBatch`); padding (``valid`` False) counts in neither sum.
        routing: makes each batch's fresh :class:`RoutingContext` (its mode says whose selection runs).
        layers: the layer indices to count, in the order of the result (default: every layer that left a
            record in the first forward, by index).
        selection (str): the :class:`~torchtune_dtf.modules.routing_context.LayerRouting` mask counted:
            ``"selected_mask"`` (the tokens that ran the block) or ``"teacher_mask"`` (the teacher's selection,
            teacher mode only).
        all_reduce (bool): sum the counts over the ranks of the default process group before dividing (each
            rank passing its own batches).

    Returns:
        Dict[int, float]: ``{layer_idx: fraction}``, NaN where ``batches`` hold no real token.
    """
    counts = None  # [len(layers) + 1] float64: tokens each layer ran, then real tokens; one host read at the end
    for ctx, valid in _routed_passes(model, batches, routing):
        if layers is None:
            layers = sorted(ctx.layers)
        ran = [(getattr(ctx.layers[idx], selection) & valid).sum() for idx in layers]
        in_batch = torch.stack([*ran, valid.sum()]).double()
        counts = in_batch if counts is None else counts + in_batch
    if counts is None:
        return {idx: math.nan for idx in layers or ()}
    if all_reduce:
        dist.all_reduce(counts)
    *ran, real = counts.tolist()
    return {idx: count / real if real else math.nan for idx, count in zip(layers, ran)}


@torch.no_grad()
def teacher_fractions(model: nn.Module, batches: Sequence[CalibrationBatch], routing: RoutingContext) -> Dict[int, float]:
    """Fraction of real tokens each calibratable layer's teacher selects on ``batches``.

    Args:
        routing (RoutingContext): a teacher-mode context (its β and capacity progress); a fresh copy per batch.
    """
    return executed_fractions(
        model, batches,
        lambda: RoutingContext(mode="teacher", beta_ce=routing.beta_ce, beta_cu=routing.beta_cu,
                               capacity_progress=routing.capacity_progress),
        layers=[layer.layer_idx for layer in calibratable_layers(model)], selection="teacher_mask",
    )


@torch.no_grad()
def student_fractions(model: nn.Module, batches: Sequence[CalibrationBatch]) -> Dict[int, float]:
    """Fraction of real tokens each calibratable layer's student executes on ``batches``."""
    return executed_fractions(
        model, batches, lambda: RoutingContext(mode="student"),
        layers=[layer.layer_idx for layer in calibratable_layers(model)],
    )


def _student_logits(model: nn.Module, batches: Sequence[CalibrationBatch]) -> Dict[int, torch.Tensor]:
    """Each calibratable layer's causal-router logits r̃ (fp32) on the real tokens of ``batches``, concatenated,
    from one ordinary student forward per batch."""
    logits: Dict[int, List[torch.Tensor]] = {layer.layer_idx: [] for layer in calibratable_layers(model)}
    for ctx, valid in _routed_passes(model, batches, lambda: RoutingContext(mode="student")):
        for idx in logits:
            logits[idx].append(ctx.layers[idx].student_logits.float()[valid])
    return {idx: torch.cat(v) for idx, v in logits.items()}


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
        rounds (int): passes over ``batches`` (≥ 1): the first in depth order, the others plain (module docstring).

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
    for idx, layer in layers.items():
        if layer.student_logit_threshold == float("-inf"):
            raise ValueError(f"Layer {idx}: student_threshold 0 runs every token; there is no threshold to calibrate")
    for round_ in range(rounds):
        logits = _held_to_target_pass(model, batches, layers, targets) if round_ == 0 else _student_logits(model, batches)
        for idx, layer in layers.items():
            layer.causal_router.out.bias.add_(layer.student_logit_threshold - _passing_quantile(logits[idx], targets[idx]))
    return student_fractions(model, batches)


def _passing_quantile(logits: torch.Tensor, fraction: float) -> float:
    """The logit above which ``fraction`` of ``logits`` lie: the (1 − f)-quantile; at f = 0 or 1 past the extremes."""
    if fraction <= 0.0:
        return float(logits.max()) + 1.0
    if fraction >= 1.0:
        return float(logits.min()) - 1.0
    return float(torch.quantile(logits, 1.0 - fraction))


def _held_to_target_pass(
    model: nn.Module, batches: Sequence[CalibrationBatch], layers: Mapping[int, RoutedSelfAttentionLayer],
    targets: Mapping[int, float],
) -> Dict[int, torch.Tensor]:
    """Student forwards over ``batches`` in which every layer in ``layers`` runs exactly its target fraction of
    each batch's real tokens (its logits shifted by that batch's own quantile, by a hook on its causal router).
    Returns each layer's logits on the real tokens as its router computed them (before that shift): a layer's
    logits are thus measured downstream of layers that already run their targets."""
    logits: Dict[int, List[torch.Tensor]] = {idx: [] for idx in layers}
    valid: List[torch.Tensor] = []  # the current batch's real tokens, read by the hooks

    def hold_to_target(idx: int, layer: RoutedSelfAttentionLayer):
        def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:  # output: [b, s] fp32 logits r̃
            real = output.float()[valid[-1]]
            logits[idx].append(real)
            return output + (layer.student_logit_threshold - _passing_quantile(real, targets[idx]))
        return hook

    handles = [layer.causal_router.register_forward_hook(hold_to_target(idx, layer)) for idx, layer in layers.items()]
    try:
        # Eager even in a compiled model: a compiled layer's graph does not call hooks added after it was traced.
        with torch.compiler.set_stance("force_eager"):
            for batch in batches:
                valid.append(_valid(batch, batch["tokens"]))
                _forward(model, batch, RoutingContext(mode="student"))
    finally:
        for handle in handles:
            handle.remove()
    return {idx: torch.cat(values) for idx, values in logits.items()}


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
