"""Choosing which tokens run a routed block, and moving them in and out of the block.

A :class:`Selection` holds, per batch row, the time-ordered positions (sequence indices) of the tokens
that run the block. A row may hold several sequences (packed documents, or left padding, where every pad
is a sequence of its own): ``starts [b, s]`` marks the first token of each, and per-sequence budgets
(top-k) count each sequence's own tokens (docs/design.md R3, R4). Rows may select different numbers of tokens (threshold routing); the index tensor
is then padded to the largest count and ``valid`` marks the real entries. Keeping indices sorted in
time order is what makes the causal mask over the gathered tokens correct (docs/design.md §3.7, §7).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Selection:
    """Tokens that run a routed block.

    Attributes:
        positions (torch.Tensor): ``[b, k]`` sequence indices of the selected tokens, ascending per row.
        valid (Optional[torch.Tensor]): ``[b, k]`` bool, False for padding entries; None when every
            row selects exactly k tokens.
        mask (torch.Tensor): ``[b, s]`` bool, True where a token runs the block.
    """

    positions: torch.Tensor
    valid: Optional[torch.Tensor]
    mask: torch.Tensor

    @property
    def num_selected(self) -> int:
        return self.positions.shape[1]


def topk_selection(scores: torch.Tensor, k: int) -> Selection:
    """Per-row top-k with deterministic ties: among equal scores the lower position wins (docs/design.md §3.9).

    Args:
        scores (torch.Tensor): ``[b, s]``.
        k (int): tokens per row, 0 ≤ k ≤ s.

    Returns:
        Selection: exactly k tokens per row, positions ascending.
    """
    # A stable descending sort keeps equal scores in position order, so ties resolve to the earlier token.
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    positions = torch.sort(order[:, :k], dim=-1).values
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, positions, True)
    return Selection(positions=positions, valid=None, mask=mask)


def sequence_bounds(starts: torch.Tensor):
    """For every token, the index of the first token of its sequence and that sequence's length.

    Args:
        starts (torch.Tensor): ``[b, s]`` bool, True at the first token of each sequence in the row.
            Position 0 always starts one.

    Returns:
        Tuple of ``[b, s]`` long tensors: (start index, sequence length).
    """
    seq_len = starts.shape[-1]
    index = torch.arange(seq_len, device=starts.device).expand_as(starts)
    starts = starts.clone()
    starts[:, 0] = True
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values
    # The next start strictly after each token (seq_len if none), by a reversed running minimum.
    later_starts = torch.where(starts, index, torch.full_like(index, seq_len))[:, 1:]
    later_starts = torch.cat([later_starts, torch.full_like(index[:, :1], seq_len)], dim=1)
    following = torch.flip(torch.cummin(torch.flip(later_starts, [-1]), dim=-1).values, [-1])
    return first, following - first


def segment_topk_selection(scores: torch.Tensor, starts: torch.Tensor, capacity: float) -> Selection:
    """Top-k within every sequence of every row: a sequence of n tokens runs ⌊γ·n⌋ of them.

    Ties resolve to the earlier token (docs/design.md §3.9). With one sequence per row this is
    :func:`topk_selection` with k = ⌊γ·s⌋.

    Args:
        scores (torch.Tensor): ``[b, s]``.
        starts (torch.Tensor): ``[b, s]`` bool, first token of each sequence (see :func:`sequence_bounds`).
        capacity (float): γ.

    Returns:
        Selection: rows may differ in count.
    """
    seq_len = scores.shape[-1]
    if not bool(starts[:, 1:].any()):
        return topk_selection(scores, int(math.floor(capacity * seq_len)))
    first, length = sequence_bounds(starts)
    budget = torch.floor(capacity * length.double()).long()
    # Descending by score (stable: earlier token first among equals), then stably grouped by sequence.
    # Sequences are contiguous, so a sequence's block in the grouped order begins at its first index.
    by_score = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    grouped = torch.gather(by_score, 1, torch.sort(torch.gather(first, 1, by_score), dim=-1, stable=True).indices)
    rank = torch.arange(seq_len, device=scores.device) - torch.gather(first, 1, grouped)
    chosen = rank < torch.gather(budget, 1, grouped)
    mask = torch.zeros_like(starts).scatter_(1, grouped, chosen)
    return mask_selection(mask)


def mask_selection(mask: torch.Tensor) -> Selection:
    """Selection from a boolean mask ``[b, s]`` (threshold routing); rows may differ in count."""
    counts = mask.sum(dim=-1)
    num_slots = int(counts.max()) if mask.numel() else 0
    if bool((counts == num_slots).all()):
        positions = torch.nonzero(mask, as_tuple=True)[1].view(mask.shape[0], num_slots)
        return Selection(positions=positions, valid=None, mask=mask)
    # Selected tokens first, each group in time order (stable sort on the "not selected" flag).
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[:, :num_slots]
    valid = torch.arange(num_slots, device=mask.device)[None, :] < counts[:, None]
    return Selection(positions=order, valid=valid, mask=mask)


def batch_topk_rows(scores: torch.Tensor, capacity: float) -> torch.Tensor:
    """Per-step budget for decoding (spec §5.1): the top ⌊γ·b⌋ rows of the batch run the block.

    Args:
        scores (torch.Tensor): ``[b]`` student logits of the current token of each row.
        capacity (float): γ.

    Returns:
        torch.Tensor: ``[b, 1]`` bool mask.

    Raises:
        ValueError: when ⌊γ·b⌋ = 0. Such a step would skip the routed layer for every row, silently;
            every generated token would leave the layer unchanged (docs/design.md R4).
    """
    num_rows = int(math.floor(capacity * scores.shape[0]))
    if num_rows == 0:
        raise ValueError(
            f"student_routing_mode='topk' decodes the top floor(capacity * batch) = floor({capacity} * "
            f"{scores.shape[0]}) = 0 rows per step: every generated token would skip this routed layer. "
            "Use student_routing_mode='threshold' (causal, per token) or decode a batch of at least "
            f"{math.ceil(1 / capacity)} rows."
        )
    return topk_selection(scores[None, :], num_rows).mask.view(-1, 1)


def gather_tokens(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...]`` gathered at ``positions [b, k]`` → ``[b, k, ...]``."""
    index = positions.view(*positions.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return torch.gather(x, 1, index)


def scatter_updates(x: torch.Tensor, selection: Selection, update: torch.Tensor) -> torch.Tensor:
    """Add ``update [b, k, d]`` to the selected tokens of ``x [b, s, d]``; others pass unchanged.

    Padding entries of a ragged selection contribute zero, so duplicate padding indices are harmless and
    the residual is added exactly once per selected token (docs/design.md §7).
    """
    if selection.valid is not None:
        update = update * selection.valid[..., None].to(update.dtype)
    index = selection.positions[..., None].expand(-1, -1, x.shape[-1])
    return x.scatter_add(1, index, update.to(x.dtype))
