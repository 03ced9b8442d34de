"""The routed training loss, its auxiliary parts and routing statistics gathered from one forward's
:class:`RoutingContext`."""

from typing import Dict, Optional, Tuple

import torch

from torchtune_dtf.modules.routing_context import RoutingContext


def auxiliary_losses(routing: RoutingContext) -> Dict[str, torch.Tensor]:
    """Per-layer auxiliary losses (already averaged over tokens) averaged over routed layers (spec §4.8).

    Returns:
        Dict with ``pred`` (PriorFFN/TPN MSE), ``causal`` (student BCE) and ``g_reg`` (mean gate); a loss
        that no routed layer produced (e.g. ``pred`` for MoD) is a zero that carries no gradient.
    """
    records = list(routing.layers.values())
    losses = {}
    for name, attr in (("pred", "pred_loss"), ("causal", "causal_loss"), ("g_reg", "g_mean")):
        values = [getattr(r, attr) for r in records if getattr(r, attr) is not None]
        losses[name] = torch.stack(values).mean() if values else torch.zeros(())
    return losses


def training_loss(
    lm_loss: torch.Tensor,
    routing: Optional[RoutingContext],
    aux_weights: Optional[Tuple[float, float, float]],
    distill: Optional[torch.Tensor] = None,
    distill_weight: float = 0.0,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """L = L_LM [+ λ_pred·L_pred + λ_causal·L_causal + λ_g_reg·L_g_reg] [+ λ_distill·L_distill] (spec §4.8,
    paper §3.3.2). The one place the objective is assembled: the recipe and the benchmarks call it.

    Args:
        lm_loss (torch.Tensor): scalar next-token loss of the routed forward.
        routing (Optional[RoutingContext]): that forward's context (teacher mode); None for models that take
            no routing decision (dense, layer dropping), which have no auxiliary losses.
        aux_weights (Optional[Tuple[float, float, float]]): (λ_pred, λ_causal, λ_g_reg) for this step, e.g.
            :meth:`~torchtune_dtf.training.schedules.LossWeights.at`; required when ``routing`` is given.
        distill (Optional[torch.Tensor]): scalar distillation loss (:func:`distillation_loss`), or None.
        distill_weight (float): λ_distill.

    Returns:
        (loss, parts): the total, and its detached parts keyed ``lm``, ``pred``, ``causal``, ``g_reg``,
        ``distill`` (those present), for logging.
    """
    loss, parts = lm_loss, {"lm": lm_loss.detach()}
    if routing is not None:
        if aux_weights is None:
            raise ValueError("A routed forward needs the auxiliary loss weights (λ_pred, λ_causal, λ_g_reg)")
        aux = auxiliary_losses(routing)
        for weight, name in zip(aux_weights, ("pred", "causal", "g_reg")):
            loss = loss + weight * aux[name]
            parts[name] = aux[name].detach()
    if distill is not None:
        loss = loss + distill_weight * distill
        parts["distill"] = distill.detach()
    return loss, parts


def _agreement(teacher: torch.Tensor, student: torch.Tensor) -> Dict[str, float]:
    true_pos = (teacher & student).sum().item()
    return {
        "accuracy": (teacher == student).float().mean().item(),
        "precision": true_pos / max(1, student.sum().item()),
        "recall": true_pos / max(1, teacher.sum().item()),
    }


def tie_share(scores: torch.Tensor) -> float:
    """Share of tokens whose ranking score equals another token's in the same row (``[b, s]``).

    Ties are decided by position, so a high share means the ranking is position order, not the signal."""
    ordered = torch.sort(scores.detach().float(), dim=-1).values
    equal_next = ordered[:, 1:] == ordered[:, :-1]
    tied = torch.zeros_like(ordered, dtype=torch.bool)
    tied[:, 1:] |= equal_next
    tied[:, :-1] |= equal_next
    return tied.float().mean().item()


def first_half_share(mask: torch.Tensor) -> float:
    """Share of the selected tokens that lie in the first half of their window (0.5 for no position bias)."""
    half = mask.shape[-1] // 2
    return (mask[:, :half].sum() / mask.sum().clamp(min=1)).item()


@torch.no_grad()
def routing_metrics(routing: RoutingContext, prefix: str = "routing") -> Dict[str, float]:
    """Flat per-layer means for logging: D_st, D_ch, S_CE, S_CU, g, o_ce, m_cu, selected fractions,
    teacher–student agreement (accuracy, precision, recall) and, for the teacher, the share of tied
    ranking scores and of selected tokens in the first half of the window (docs/design.md R1) and, for SDT/STT,
    the shares of its selected tokens whose CE and whose CU criterion is positive, keyed
    ``{prefix}/layer_{i}/{name}``."""
    metrics: Dict[str, float] = {}
    for idx, record in sorted(routing.layers.items()):
        key = f"{prefix}/layer_{idx}"
        for name in ("d_st", "d_ch", "s_ce", "s_cu", "g", "o_ce", "m_cu"):
            value = getattr(record, name)
            if value is not None:
                metrics[f"{key}/{name}"] = value.float().mean().item()
        metrics[f"{key}/selected_fraction"] = record.selected_fraction.item()
        if record.teacher_mask is not None:
            metrics[f"{key}/teacher_fraction"] = record.teacher_mask.float().mean().item()
            if record.ce is not None:
                # Which criterion fired for the tokens the teacher chose (paper §4: CU early, CE later?).
                chosen = record.teacher_mask
                count = chosen.sum().clamp(min=1)
                metrics[f"{key}/teacher_ce_share"] = (((record.ce > 0) & chosen).sum() / count).item()
                metrics[f"{key}/teacher_cu_share"] = (((record.cu > 0) & chosen).sum() / count).item()
            metrics[f"{key}/teacher_first_half_share"] = first_half_share(record.teacher_mask)
            score = record.score if record.score is not None else record.router_logits
            if score is not None:
                metrics[f"{key}/score_tie_share"] = tie_share(score)
        if record.student_mask is not None:
            metrics[f"{key}/student_fraction"] = record.student_mask.float().mean().item()
            for name, value in _agreement(record.teacher_mask, record.student_mask).items():
                metrics[f"{key}/agreement_{name}"] = value
    return metrics


def distillation_loss(
    student_logits, teacher_logits, labels: torch.Tensor, temperature: float, ignore_index: int
) -> torch.Tensor:
    """T²·KL(softmax(t/T) ‖ softmax(s/T)) averaged over target tokens (labels ≠ ``ignore_index``).

    Args:
        student_logits, teacher_logits: ``[b, s, v]`` tensors or lists of chunks along s (torchtune's
            chunked output), chunked the same way.
        labels (torch.Tensor): ``[b, s]`` next-token targets aligned with the logits.
        temperature (float): T.
        ignore_index (int): label of positions without a target.
    """
    if isinstance(student_logits, torch.Tensor):
        student_logits, teacher_logits = [student_logits], [teacher_logits]
    label_chunks = labels.chunk(len(student_logits), dim=1)
    total = student_logits[0].new_zeros((), dtype=torch.float32)
    for student, teacher, chunk_labels in zip(student_logits, teacher_logits, label_chunks):
        log_p_student = torch.log_softmax(student.float() / temperature, dim=-1)
        log_p_teacher = torch.log_softmax(teacher.float() / temperature, dim=-1)
        per_token = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1)
        total = total + (per_token * (chunk_labels != ignore_index)).sum()
    count = (labels != ignore_index).sum().clamp(min=1)
    return temperature**2 * total / count
