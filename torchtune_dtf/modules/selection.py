"""Choosing which tokens run a routed block, and moving them in and out of the block.

A :class:`Selection` holds, per batch row, the time-ordered positions (sequence indices) of the tokens
that run the block. A row may hold several sequences (packed documents, or left padding, where every pad
is a sequence of its own): ``starts [b, s]`` marks the first token of each, and per-sequence budgets
(top-k) count each sequence's own tokens (docs/design.md R3, R4). Rows may select different numbers of tokens (threshold routing); the index tensor
is then padded to a slot count and ``valid`` marks the real entries. Keeping indices sorted in
time order is what makes the causal mask over the gathered tokens correct (docs/design.md §3.7, §7).

Shapes are static wherever the budget is (top-k): a row of s tokens holds at most ⌊γ·s⌋ selected tokens
however it splits into sequences (Σ⌊γ·n_i⌋ ≤ ⌊γ·Σn_i⌋), and a decode step runs ⌊γ·b⌋ rows. Those paths read
nothing back from the device, so ``torch.compile(fullgraph=True)`` captures them whole. Threshold routing
and the causal window top-k (:func:`window_topk_mask`) have a data-dependent count; :func:`mask_selection`
read it once per call, and a decode step reads how many rows run (:func:`row_selection`).
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass
class Selection:
    """Tokens that run a routed block.

    Attributes:
        positions (torch.Tensor): ``[b, k]`` sequence indices of the selected tokens, ascending per row.
        valid (Optional[torch.Tensor]): ``[b, k]`` bool, False for padding entries; None when every
            row selects exactly k tokens.
        mask (torch.Tensor): ``[b, s]`` bool, True where a token runs the block.
        rows (Optional[torch.Tensor]): ``[r]`` ascending batch rows that run anything (decoding, one token
            per row); ``positions`` is then ``[r, 1]`` and describes those rows only. None: every row of
            ``positions`` is its batch row.
        fewest_selected (Optional[int]): the smallest number of tokens any row selects, when the host knows it
            without reading the device (top-k: k; threshold: from the read that sized the selection); None
            otherwise.
    """

    positions: torch.Tensor
    valid: Optional[torch.Tensor]
    mask: torch.Tensor
    rows: Optional[torch.Tensor] = None
    fewest_selected: Optional[int] = None

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
    return Selection(positions=positions, valid=None, mask=mask, fewest_selected=k)


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


def segment_topk_selection(
    scores: torch.Tensor, starts: torch.Tensor, capacity: float, *, single_sequence: bool = False
) -> Selection:
    """Top-k within every sequence of every row: a sequence of n tokens runs ⌊γ·n⌋ of them.

    Ties resolve to the earlier token (docs/design.md §3.9). The selection has ⌊γ·s⌋ slots per row, the
    most any split into sequences can fill, so its shape never depends on the data; rows whose sequences
    leave slots over mark them invalid.

    Args:
        scores (torch.Tensor): ``[b, s]``.
        starts (torch.Tensor): ``[b, s]`` bool, first token of each sequence (see :func:`sequence_bounds`).
        capacity (float): γ.
        single_sequence (bool): the caller knows every row is one sequence (no mask, no position ids):
            plain :func:`topk_selection` with k = ⌊γ·s⌋, every slot valid.

    Returns:
        Selection: ``[b, ⌊γ·s⌋]`` positions.
    """
    seq_len = scores.shape[-1]
    num_slots = int(math.floor(capacity * seq_len))
    if single_sequence:
        return topk_selection(scores, num_slots)
    first, length = sequence_bounds(starts)
    budget = torch.floor(capacity * length.double()).long()
    # Descending by score (stable: earlier token first among equals), then stably grouped by sequence.
    # Sequences are contiguous, so a sequence's block in the grouped order begins at its first index.
    by_score = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    grouped = torch.gather(by_score, 1, torch.sort(torch.gather(first, 1, by_score), dim=-1, stable=True).indices)
    rank = torch.arange(seq_len, device=scores.device) - torch.gather(first, 1, grouped)
    chosen = rank < torch.gather(budget, 1, grouped)
    mask = torch.zeros_like(starts).scatter_(1, grouped, chosen)
    return slots_selection(mask, num_slots)


def slots_selection(mask: torch.Tensor, num_slots: int) -> Selection:
    """Selection of ``num_slots`` entries per row from a mask ``[b, s]`` that selects at most that many
    per row (static shape, no host read): selected tokens first in time order, then padding."""
    counts = mask.sum(dim=-1)
    # Selected tokens first, each group in time order (stable sort on the "not selected" flag).
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[:, :num_slots]
    valid = torch.arange(num_slots, device=mask.device)[None, :] < counts[:, None]
    return Selection(positions=order, valid=valid, mask=mask)


def row_count_extremes(mask: torch.Tensor) -> torch.Tensor:
    """``[2]`` the largest and the smallest row count of a non-empty mask ``[b, s]``: what :func:`mask_selection`
    needs on the host, for the caller to read in one transfer."""
    counts = mask.sum(dim=-1)
    return torch.stack([counts.max(), counts.min()])


def mask_selection(mask: torch.Tensor, extremes: Optional[Tuple[int, int]] = None) -> Selection:
    """Selection from a boolean mask ``[b, s]`` (threshold routing); rows may differ in count.

    The number of slots is the largest row count: ``extremes`` (most, fewest), read by the caller
    (:func:`row_count_extremes`), or read here from the device (the one host read of a threshold-routed
    layer's forward)."""
    if not mask.numel():
        return Selection(positions=mask.new_zeros(mask.shape[0], 0, dtype=torch.long), valid=None, mask=mask)
    most, fewest = row_count_extremes(mask).tolist() if extremes is None else extremes
    selection = slots_selection(mask, most)
    selection.fewest_selected = fewest
    if most == fewest:
        selection.valid = None  # every slot is a selected token
    return selection


def skipped_selection(selection: Selection) -> Optional[Selection]:
    """The tokens ``selection`` skips, as a selection of their own (time order, padded like any ragged one),
    so that work only skipped tokens need (the skip-path forecast) runs on them alone.

    Returns None when the number of slots is not known on the host without a read (packed top-k, decoding):
    the caller then computes for every token and masks."""
    if selection.rows is not None or selection.fewest_selected is None:
        return None
    skipped = slots_selection(~selection.mask, selection.mask.shape[1] - selection.fewest_selected)
    if selection.valid is None:
        skipped.valid = None  # every row selects (hence skips) the same number
    return skipped


def window_topk_mask(
    scores: torch.Tensor, starts: torch.Tensor, capacity: float, recent: torch.Tensor, recent_valid: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal top-γ over a sliding window (``student_routing_mode: window_topk``): token t runs when its
    mid-rank among the n_t tokens of its sequence in the window of w ending at t (t included) is inside the
    top γ: #{higher} + ½·#{equal, t included} < γ·n_t.

    The mid-rank matters for small n (a sequence's first tokens): a plain rank (#{higher} < γ·n) runs ⌈γ·n⌉
    of n i.i.d. tokens in expectation (1 of 1, 2 of 3 at γ = ½), which inflates a short text's executed
    fraction; the mid-rank runs γ·n rounded to the nearest integer, halves down.

    A fixed threshold holds its budget only on text like its calibration text; a model's own generations
    (repetitions, newline loops) shift every score and with them the executed fraction. A rank among the
    layer's own recent scores is a threshold that follows the shift, so about γ of every window runs (not
    when scores keep rising or falling for longer than the window: then every token is its window's best or
    worst). The rule reads scores only, never earlier decisions, so a whole sequence is decided in one parallel
    pass and a decode step (s = 1, the window carried in the cache) decides exactly as the full forward.

    Args:
        scores (torch.Tensor): ``[b, s]`` fp32 router logits of this chunk.
        starts (torch.Tensor): ``[b, s]`` bool, first token of each sequence (the window never crosses one).
        capacity (float): γ.
        recent (torch.Tensor): ``[b, w − 1]`` the scores of the w − 1 tokens before this chunk, oldest first.
        recent_valid (torch.Tensor): ``[b, w − 1]`` bool, which of them belong to the sequence the chunk
            continues (all False at the start, or without a cache).

    Returns:
        Tuple of ``mask [b, s]`` (tokens that run) and the window to carry into the next chunk,
        ``recent [b, w − 1]`` and ``recent_valid [b, w − 1]``.
    """
    if scores.shape[1] == 1:
        return _window_topk_step(scores, starts, capacity, recent, recent_valid)
    width = recent.shape[1] + 1
    seq_len = scores.shape[1]
    extended = torch.cat([recent.to(scores.dtype), scores], dim=1)  # [b, w − 1 + s]
    member = torch.cat([recent_valid, torch.ones_like(starts)], dim=1)
    # Sequence number of every entry: the carried window is sequence 0, each start in the chunk opens the next.
    sequence = torch.cat([torch.zeros_like(recent_valid, dtype=torch.long), starts.long()], dim=1).cumsum(dim=1)
    window_scores = extended.unfold(1, width, 1)  # [b, s, w]; entry w − 1 is the token itself
    same = member.unfold(1, width, 1) & (sequence.unfold(1, width, 1) == sequence[:, width - 1:, None])
    higher = ((window_scores > scores[..., None]) & same).sum(dim=-1)
    equal = ((window_scores == scores[..., None]) & same).sum(dim=-1)  # ≥ 1: the token itself
    mask = (higher + 0.5 * equal) < capacity * same.sum(dim=-1)
    carried = slice(seq_len, None)  # the last w − 1 entries
    carried_valid = (member & (sequence == sequence[:, -1:]))[:, carried]
    return mask, extended[:, carried], carried_valid


def _window_topk_step(
    scores: torch.Tensor, starts: torch.Tensor, capacity: float, recent: torch.Tensor, recent_valid: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`window_topk_mask` for one token per row (``scores [b, 1]``, a decode step), the same counts in a
    third of the operators: the window is the carried w − 1 scores and the token, so no concatenated copy and no
    unfolded view. A carried score is in the token's sequence when the token continues one (not a start) and the
    score belonged to it; the token itself is one higher-or-equal entry of its own window."""
    continued = recent_valid & ~starts  # [b, w − 1]
    recent = recent if recent.dtype == scores.dtype else recent.to(scores.dtype)
    higher = ((recent > scores) & continued).sum(dim=-1, keepdim=True)
    # + the token itself (as in the full window, where a NaN score would equal nothing, not even itself)
    equal = ((recent == scores) & continued).sum(dim=-1, keepdim=True) + (scores == scores)
    members = continued.sum(dim=-1, keepdim=True) + 1
    mask = (higher + 0.5 * equal) < capacity * members
    # Carried on: the last w − 2 scores and this one; a carried score stays valid if it is in the token's sequence.
    carried = torch.cat([recent[:, 1:], scores], dim=1)
    carried_valid = torch.cat([continued[:, 1:], torch.ones_like(starts)], dim=1)
    return mask, carried, carried_valid


def row_selection(mask: torch.Tensor, num_rows: int) -> Selection:
    """Selection of a decode step (one token per row) from a mask ``[b, 1]`` that ``num_rows`` rows set (threshold
    routing; the caller read the count from the device, the step's one host read).

    With the count known on the host every shape here is static: all rows or none need no index search, and
    otherwise the running rows are the first ``num_rows`` of a stable sort that puts them first in row order."""
    batch = mask.shape[0]
    if num_rows == batch:
        rows = torch.arange(batch, device=mask.device)
    elif num_rows == 0:
        rows = torch.zeros(0, dtype=torch.long, device=mask.device)
    else:
        rows = torch.sort((~mask[:, 0]).to(torch.int8), stable=True).indices[:num_rows]
    return Selection(positions=rows.new_zeros(num_rows, 1), valid=None, mask=mask, rows=rows)


def batch_topk_selection(scores: torch.Tensor, capacity: float) -> Selection:
    """Per-step budget for decoding (spec §5.1): the top ⌊γ·b⌋ rows of the batch run the block.

    Args:
        scores (torch.Tensor): ``[b]`` student logits of the current token of each row.
        capacity (float): γ.

    Returns:
        Selection: ``rows [⌊γ·b⌋]`` ascending, ``positions [⌊γ·b⌋, 1]`` (zeros), ``mask [b, 1]``; static shapes.

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
    chosen = topk_selection(scores[None, :], num_rows)
    rows = chosen.positions[0]
    return Selection(positions=torch.zeros_like(rows)[:, None], valid=None, mask=chosen.mask.view(-1, 1), rows=rows)


def gather_tokens(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...]`` gathered at ``positions [b, k]`` → ``[b, k, ...]``."""
    index = positions.view(*positions.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return torch.gather(x, 1, index)


def scatter_updates(x: torch.Tensor, selection: Selection, update: torch.Tensor) -> torch.Tensor:
    """Add ``update [b, k, d]`` to the selected tokens of ``x [b, s, d]``; others pass unchanged.

    Padding entries of a ragged selection contribute nothing (docs/design.md §7): the residual is added exactly
    once per selected token.

    Written as a gather, not a scatter: a selected token's slot in ``update`` is its rank among the row's selected
    tokens (``positions`` hold them first, in time order, so the rank is a running count of ``mask``), so every
    output token reads its own update or none. Compiled, that is one fused pass over ``x``; inductor runs a
    scatter as a copy of ``x`` and a separate scatter call (≈ 1–2 % of a SmolLM2-shape layer's b1 × 1024 prefill,
    twice in a layer that forecasts its skipped tokens). Decode steps of some rows (``selection.rows``) describe
    fewer rows than ``x`` has and keep the scatter.
    """
    if selection.valid is None and x.shape[1] == 1 and update.shape[1] == 1:
        return x + update.to(x.dtype)  # one token per row (a decode step), and it is selected: the scatter is an add
    if selection.mask.shape == x.shape[:2]:
        slot = (selection.mask.cumsum(dim=1) - 1).clamp(min=0)  # rank among the row's selected tokens
        return torch.where(selection.mask[..., None], x + gather_tokens(update.to(x.dtype), slot), x)
    if selection.valid is not None:
        update = update * selection.valid[..., None].to(update.dtype)
    index = selection.positions[..., None].expand(-1, -1, x.shape[-1])
    return x.scatter_add(1, index, update.to(x.dtype))
