"""Routed decoder layers: MoD, SDT (Decision + Dynamic) and STT.

Each routed layer *is* a ``TransformerSelfAttentionLayer`` — torchtune dispatches on that class for KV
caches, activation checkpointing, compile and FSDP wrapping — so its block weights keep the dense key
names (``layers.3.attn.q_proj.weight``) and a stock checkpoint maps 1:1. The routing modules are extra
children: ``mod_router``, ``causal_router``, ``transition`` (TPN), ``prior_ffn``, ``predictive_router``,
``skip_bias``, ``skip_linear``.

What differs between variants is only how the teacher decides (selection and gate); execution is the
shared :func:`routed_block_forward`, and the student (causal router) is the same everywhere.
"""

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import MultiHeadAttention, TransformerSelfAttentionLayer

from torchtune_dtf.modules.predictors import ResidualPredictor, SkipBias, SkipLinear
from torchtune_dtf.modules.routed_block import branching_decode_step, routed_block_forward
from torchtune_dtf.modules.routers import CausalRouter, MoDRouter, carried_copy, previous_token_states
from torchtune_dtf.modules.routing_context import LayerRouting, RoutingContext
from torchtune_dtf.modules.selection import (
    Selection,
    batch_topk_selection,
    gather_tokens,
    mask_selection,
    row_count_extremes,
    row_selection,
    scatter_updates,
    segment_topk_selection,
    skipped_selection,
    window_topk_mask,
)
from torchtune_dtf.modules.selective_kv_cache import SelectiveKVCache
from torchtune_dtf.modules.surprise import (
    PredictiveRouter,
    change_surprise,
    gate_threshold_score,
    static_surprise,
)

#: Every routing module a layer may own, by attribute name (every other parameter is the pretrained backbone),
#: and the optimizer group that trains it: the predictors of the block's update, the predictive router's
#: offsets (o_ce, m_cu), and the routers. The skip bias (one d-vector per layer, ``skip_update: bias``) trains
#: with the routers: like them it is a small per-layer module that starts from nothing and must move within a
#: short fine-tune. The skip linear map (``skip_update: linear``, d² + d per layer) has a group of its own,
#: ``skip_maps``: started at a least-squares fit, it needs a backbone-like learning rate, not a router's.
ROUTING_MODULE_GROUPS = {  # group order = the optimizer's param-group order, which checkpoints record
    "transition": "predictors",
    "prior_ffn": "predictors",
    "predictive_router": "predictive_router",
    "mod_router": "routers",
    "causal_router": "routers",
    "skip_bias": "routers",
    "skip_linear": "skip_maps",
}
ROUTING_MODULE_NAMES = tuple(ROUTING_MODULE_GROUPS)
STUDENT_ROUTING_MODES = ("threshold", "topk", "window_topk")
TEACHER_SELECTIONS = ("topk", "threshold")
GATE_MODES = ("scaled", "straight_through")
#: Student modes whose number of running tokens depends on the data (read from the device once per forward).
_COUNTED_MODES = ("threshold", "window_topk")
SKIP_UPDATES = ("none", "predicted", "bias", "linear")


def token_positions(
    input_pos: Optional[torch.Tensor], batch: int, seq_len: int, offset, device: torch.device
) -> torch.Tensor:
    """Position ids ``[b, s]`` from torchtune's ``input_pos`` (``None``, ``[s]``, ``[b]`` when decoding
    one token, or ``[b, s]``). ``offset`` (an int, or the cache's 0-dim ``seen`` tensor, never read back to
    the host) is the layout slot of the chunk's first token."""
    if input_pos is None:
        return (offset + torch.arange(seq_len, device=device)).expand(batch, seq_len)
    if input_pos.dim() <= 1:
        input_pos = input_pos.view(-1, 1) if seq_len == 1 else input_pos.view(1, -1)
    return input_pos.expand(batch, seq_len)


def sequence_starts(positions: torch.Tensor, mask: Optional[torch.Tensor], offset) -> torch.Tensor:
    """``[b, s]`` bool: True where a token begins a sequence and so has no predecessor.

    A token starts a sequence when its position id is 0, or when the attention mask does not let it see
    the token just before it in the layout: the first token of a packed document (block-causal mask,
    docs/design.md R3), every left pad and the first real token after them (torchtune's generation masks).

    Args:
        positions (torch.Tensor): ``[b, s]`` position ids.
        mask (Optional[torch.Tensor]): ``[b, s, L]`` boolean mask over layout slots, or None.
        offset (int or 0-dim tensor): layout slot of the chunk's first token (tokens already in the cache).
    """
    starts = positions == 0
    if mask is None:
        return starts
    seq_len = positions.shape[1]
    if seq_len == 1 and isinstance(offset, torch.Tensor):
        # A decode step: the token's slot is ``offset``, so its predecessor's column of the mask is read directly
        # (the same value as the general path's index arrays, in a few operators).
        previous = (offset - 1).clamp(min=0).view(1)
        sees_previous = mask.index_select(2, previous)[:, :, 0]
        return starts | ~(sees_previous & (offset > 0))
    slots = offset + torch.arange(seq_len, device=positions.device)
    sees_previous = mask[:, torch.arange(seq_len, device=mask.device), (slots - 1).clamp(min=0)]
    return starts | ~(sees_previous & (slots > 0))


def _every_row_skipped(selection: Selection, batch: int) -> Optional[bool]:
    """For a decode step (one token per row), True when no row runs the block and False when every row does, as
    the host knows from the number of running rows; None otherwise (mixed rows, or not a decode step).

    The skip path's update (skip bias, forecast) is then added to every token or to none, instead of being
    multiplied by the skip mask: the same values (times 1, or an added ±0) without the mask's operators."""
    if selection.rows is None:
        return None
    running = selection.rows.shape[0]
    return True if running == 0 else False if running == batch else None


def _dense_forward(layer: TransformerSelfAttentionLayer, x, mask, input_pos) -> torch.Tensor:
    return TransformerSelfAttentionLayer.forward(layer, x, mask=mask, input_pos=input_pos)


class RoutedSelfAttentionLayer(TransformerSelfAttentionLayer):
    """Base of the routed layers: student routing, the selective cache, execution and bookkeeping.

    Args:
        attn, mlp, sa_norm, mlp_norm: the block, exactly as in the dense layer.
        layer_idx (int): index of this layer in the decoder (key of its :class:`LayerRouting`).
        capacity (float): γ ∈ (0, 1]; top-k keeps ⌊γ·n⌋ tokens of each sequence of n tokens.
        causal_router (CausalRouter): the student.
        student_routing_mode (str): ``"threshold"`` (σ(r̃) > τ, causal; evaluation), ``"topk"``
            (per-sequence top-k on a cached prefill, per-step top ⌊γ·b⌋ rows when decoding; docs/design.md §4)
            or ``"window_topk"`` (causal: a token runs when its r̃ is in the top γ of its sequence's last
            ``student_window`` scores, itself included; :func:`window_topk_mask`). Threshold and window
            top-k are causal and score log-likelihoods; window top-k follows a shift of the scores (a
            model's own generations), a threshold holds γ only on text like its calibration text.
        student_threshold (Optional[float]): τ for threshold mode.
        student_window (Optional[int]): w ≥ 2 for window top-k mode.
        gate (str): how a selected token's update is scaled (docs/design.md R2). ``"scaled"``: by the gate in
            training (g for SDT/STT, σ(r) for MoD, as the papers); at inference SDT/STT apply 1 (g needs the
            block's own output) and MoD σ(r). ``"straight_through"``: forward value 1 in training and
            inference, gradient through the gate, so the training forward is what inference computes.
        always_run_first_token (bool): the first token of every sequence always runs the block (it
            counts towards the capacity); the usual attention sink otherwise loses to the surprise rule,
            which disfavours it (no TPN prediction, CU_0 = (1 − m_cu)·D_st < 0).
        allow_noncausal_student_topk (bool): permit student top-k on a whole sequence without a cache.
            That selection is not causal (a token's fate depends on later tokens), so by default it is an
            error; set True only for an explicit analysis, never for evaluation.
        skipped_tokens_write_kv (bool): context-preserving attention: skipped tokens still compute and
            store their K/V, so selected tokens see the whole context (see :func:`routed_block_forward`).
        skip_update (str): what a skipped token receives: ``"none"`` (it passes unchanged, the papers),
            ``"predicted"``, the variant's own forecast of the block's update (:meth:`skip_forecast`), or
            ``"bias"``, a learned constant update (:class:`SkipBias`, child ``skip_bias``; every variant), or
            ``"linear"``, a learned affine map of the token's input (:class:`SkipLinear`, child ``skip_linear``;
            every variant).
    """

    def __init__(
        self,
        attn: MultiHeadAttention,
        mlp: nn.Module,
        *,
        sa_norm: nn.Module,
        mlp_norm: nn.Module,
        layer_idx: int,
        capacity: float,
        causal_router: Optional[CausalRouter],
        student_routing_mode: str,
        student_threshold: Optional[float],
        student_window: Optional[int],
        gate: str,
        always_run_first_token: bool,
        allow_noncausal_student_topk: bool,
        skipped_tokens_write_kv: bool,
        skip_update: str,
    ) -> None:
        super().__init__(attn=attn, mlp=mlp, sa_norm=sa_norm, mlp_norm=mlp_norm)
        if skip_update not in SKIP_UPDATES:
            raise ValueError(f"Unknown skip_update {skip_update!r}; expected one of {SKIP_UPDATES}")
        if student_routing_mode not in STUDENT_ROUTING_MODES:
            raise ValueError(f"Unknown student_routing_mode {student_routing_mode!r}")
        if gate not in GATE_MODES:
            raise ValueError(f"Unknown gate {gate!r}; expected one of {GATE_MODES}")
        self.layer_idx = layer_idx
        self.capacity = capacity
        self.causal_router = causal_router
        self.student_routing_mode = student_routing_mode
        self.student_threshold = student_threshold
        self.student_window = student_window
        if student_routing_mode == "window_topk" and not (isinstance(student_window, int) and student_window >= 2):
            raise ValueError(f"Routed layer {layer_idx}: window_topk needs student_window ≥ 2, got {student_window!r}")
        self.gate = gate
        self.always_run_first_token = always_run_first_token
        self.allow_noncausal_student_topk = allow_noncausal_student_topk
        self.skipped_tokens_write_kv = skipped_tokens_write_kv
        self.skip_update = skip_update
        if skip_update == "bias":
            self.skip_bias = SkipBias(attn.embed_dim)
        elif skip_update == "linear":
            self.skip_linear = SkipLinear(attn.embed_dim, sa_norm.eps)
        # σ(r̃) > τ compared as r̃ > logit(τ) on fp32 logits: σ rounds to 1.0 (or 0.0) long before r̃ does.
        self.student_logit_threshold = None
        if student_routing_mode == "threshold":
            tau = student_threshold
            self.student_logit_threshold = -math.inf if tau == 0 else math.log(tau) - math.log1p(-tau)
        # Student-mode counters (see :meth:`routing_counts`): registered empty and created on the first
        # counted forward, on its device. A model built on the meta device (FSDP, benchmarks) then has
        # nothing to materialise beyond what torchtune already handles (RoPE), and they never reach a
        # checkpoint (non-persistent).
        self.register_buffer("routed_tokens_seen", None, persistent=False)
        self.register_buffer("routed_tokens_executed", None, persistent=False)
        #: Caches made by :meth:`setup_caches` are static (full size, no host reads); see there.
        self.static_kv_cache = False

    # -- caches ---------------------------------------------------------------------------------
    def setup_caches(
        self, batch_size: int, dtype: torch.dtype, *, encoder_max_seq_len: int, decoder_max_seq_len: int
    ) -> None:
        """Give this layer a :class:`SelectiveKVCache` instead of torchtune's shared-position cache.

        The cache starts with room for ⌈γ·max_seq_len⌉ entries per row, what this layer runs at its
        configured capacity, and grows only if a row executes more (threshold students can). With
        ``static_kv_cache`` (set by :meth:`RoutedTransformerDecoder.use_static_kv_caches`, for compiled
        decoding) it holds ``max_seq_len`` entries from the start and never reads fill levels back."""
        attn = self.attn
        attn.kv_cache = SelectiveKVCache(
            batch_size=batch_size,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            max_seq_len=decoder_max_seq_len,
            embed_dim=attn.embed_dim,
            dtype=dtype,
            initial_entries=(
                decoder_max_seq_len if self.skipped_tokens_write_kv else max(1, math.ceil(self.capacity * decoder_max_seq_len))
            ),
            static=self.static_kv_cache,
            score_history=self.student_window - 1 if self.student_routing_mode == "window_topk" else 0,
            router_carry_dim=0 if self.causal_router is None else self.causal_router.carry_dim,
        )
        attn.cache_enabled = True

    def _active_cache(self) -> Optional[SelectiveKVCache]:
        return self.attn.kv_cache if (self.attn.kv_cache is not None and self.attn.cache_enabled) else None

    # -- inference counters ---------------------------------------------------------------------
    def routing_counts(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Tokens this layer executed and saw in student (inference) mode since the last reset.

        What is counted, per student-mode forward of ``x [b, s, d]``: ``seen += b·s`` and ``executed +=``
        the number of tokens whose block ran (the ``selected_mask [b, s]`` that forward records in its
        :class:`RoutingContext`). With a KV cache that is the prefill's b·s tokens and then b tokens per
        decode step (one per row, rows that already stopped included, as torchtune's ``generate`` keeps
        decoding them). Padding is counted like any token: the layer cannot tell it apart (a left pad
        looks like the start of a one-token sequence under torchtune's generation masks, a right pad like
        an ordinary token, and an eval wrapper's filler rows are real tokens), and the block really runs
        on a pad the student selects. Executed means the block ran on the token; with
        ``skipped_tokens_write_kv`` a skipped token still computes its K/V, which is not counted.

        Not counted: teacher-mode forwards (training, also with ``execute="student"``) and
        ``RoutingContext(mode="dense")`` forwards (distillation teacher, dense references), so the
        counters describe the deployed causal router only. Student-mode forwards during training
        (validation, calibration) do count; reset before measuring. A student-mode forward recomputed
        under activation checkpointing would count twice (training runs its gradient forwards in
        teacher mode, so this does not arise there). Counts are per process (each data-parallel rank
        counts its own rows).

        The counters are updated on device without host synchronisation (no ``.item()`` per forward);
        reading them as Python numbers (:meth:`RoutedTransformerDecoder.executed_fractions`) syncs once.

        Returns:
            Tuple[torch.Tensor, torch.Tensor]: (executed, seen), each a 0-dim int64 tensor on the layer's
            device (the buffers themselves; zeros before any counted forward).
        """
        if self.routed_tokens_seen is None:
            self._create_routing_counters(next(self.parameters()).device)
        return self.routed_tokens_executed, self.routed_tokens_seen

    def reset_routing_counters(self) -> None:
        """Set both counters to zero (in place, no allocation)."""
        if self.routed_tokens_seen is not None:
            self.routed_tokens_seen.zero_()
            self.routed_tokens_executed.zero_()

    def _create_routing_counters(self, device: torch.device) -> None:
        # inference_mode(False): created during torchtune's @inference_mode generate, an inference tensor
        # could never again be updated in place outside inference mode (lm-eval's loglikelihood passes).
        with torch.inference_mode(False):
            self.routed_tokens_seen = torch.zeros((), dtype=torch.long, device=device)
            self.routed_tokens_executed = torch.zeros((), dtype=torch.long, device=device)

    def _count_student(self, selected: torch.Tensor) -> None:
        """Add one student-mode forward to the counters. ``selected``: ``[b, s]`` bool, tokens that ran."""
        if self.routed_tokens_seen is None:
            self._create_routing_counters(selected.device)
        # In place, not ``+=``: that re-assigns the buffer, a ``Module.__setattr__`` per forward, which a compiled
        # layer traces (through ``inspect.signature``: dozens of guards) and replays after its graph.
        self.routed_tokens_seen.add_(selected.numel())  # a Python int: no device round trip
        self.routed_tokens_executed.add_(selected.sum())  # stays on device: no host sync per forward

    def token_layout(
        self, mask: Optional[torch.Tensor], input_pos: Optional[torch.Tensor], batch: int, seq_len: int,
        device: torch.device,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Position ids and sequence starts ``[b, s]`` of a forward's tokens (:func:`token_positions`,
        :func:`sequence_starts`), the chunk placed after what this layer's active cache has seen.
        ``mask``: ``[b, s, L]`` (already expanded over the batch) or None."""
        cache = self._active_cache()
        offset = 0 if cache is None else cache.seen  # a device tensor: never read back to the host
        positions = token_positions(input_pos, batch, seq_len, offset, device)
        return positions, sequence_starts(positions, mask, offset)

    # -- decisions ------------------------------------------------------------------------------
    def num_selected(self, seq_len: int) -> int:
        return int(math.floor(self.capacity * seq_len))

    def student_logits(
        self, x: torch.Tensor, starts: torch.Tensor, cache: Optional[SelectiveKVCache]
    ) -> torch.Tensor:
        """Causal router logits ``[b, s]`` (fp32) from detached inputs (the student never trains the backbone).
        With a cache, the term this chunk's last token hands the next chunk's router is stored in it."""
        logits, carry = self.student_logits_and_carry(x, starts, cache, copy_carried=torch.compiler.is_compiling())
        if carry is not None:
            cache.carry_router_term(carry)  # read by this chunk only above: the next chunk's first token's term
        return logits

    def student_logits_and_carry(
        self, x: torch.Tensor, starts: torch.Tensor, cache: Optional[SelectiveKVCache], *, copy_carried: bool
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`student_logits` without storing: (logits ``[b, s]``, the term ``[b, h]`` for the cache to carry, or
        None without a cache or without the previous token's input), for a caller that stores it later.

        ``copy_carried``: read the cache's carried term through :func:`~torchtune_dtf.modules.routers.carried_copy`,
        which compiled code needs when the term is overwritten in the same graph that reads it (an inductor bug,
        see there). A compiled threshold or window top-k layer stores it after its host read, in the next graph,
        and so spares the copy (a Python operator call, 10–30 µs per routed layer and decode step on a CPU)."""
        if cache is None:
            return self.causal_router(x.detach(), starts), None
        carried = cache.router_carry
        if copy_carried and self.causal_router.carry_dim:
            carried = carried_copy(carried)
        # A router without the previous token reads no carried term and hands none on (``router_carry`` is [b, 0]).
        return self.causal_router(x.detach(), starts, carried, return_carried=True)

    def topk_by_sequence(
        self,
        scores: torch.Tensor,
        starts: torch.Tensor,
        capacity: Optional[float] = None,
        *,
        single_sequence: bool,
    ) -> Selection:
        """Per-sequence top-k of ``scores [b, s]`` at ``capacity`` (the layer's γ when None); with
        ``always_run_first_token`` each sequence's first token is taken first, inside the budget.
        ``single_sequence``: every row is one sequence (the forward got neither a mask nor position ids),
        known without looking at the data."""
        if self.always_run_first_token:
            scores = scores.masked_fill(starts, math.inf)
        capacity = self.capacity if capacity is None else capacity
        return segment_topk_selection(scores, starts, capacity, single_sequence=single_sequence)

    def by_threshold(self, selected: torch.Tensor, starts: torch.Tensor) -> Selection:
        return mask_selection(selected | starts if self.always_run_first_token else selected)

    def student_selection(
        self,
        logits: torch.Tensor,
        starts: torch.Tensor,
        cache: Optional[SelectiveKVCache],
        *,
        single_sequence: bool,
        analysis: bool = False,
    ) -> Selection:
        """What the deployed student runs. ``analysis=True`` (teacher–student agreement during training)
        permits the non-causal whole-sequence top-k that is otherwise refused.

        A decode step (a cache and one token per row) selects rows: the top ⌊γ·b⌋ in top-k mode (static,
        no host read), those over the threshold or in their window's top γ otherwise (one host read)."""
        decoding = cache is not None and logits.shape[1] == 1
        if self.student_routing_mode in _COUNTED_MODES:
            selected = self.student_mask(logits, starts, cache)
            return row_selection(selected, selected.sum().tolist()) if decoding else mask_selection(selected)
        if decoding:
            return batch_topk_selection(logits[:, 0], self.capacity)
        if cache is None and not (analysis or self.allow_noncausal_student_topk):
            raise ValueError(
                f"Routed layer {self.layer_idx}: student_routing_mode='topk' on a whole sequence without a "
                "KV cache is a per-sequence top-k, which is not causal (whether a token runs depends on later "
                "tokens), so it cannot score log-likelihoods. Use student_routing_mode='threshold' for "
                "evaluation, or set allow_noncausal_student_topk: True for an explicit analysis."
            )
        return self.topk_by_sequence(logits, starts, single_sequence=single_sequence)

    def student_mask(self, logits: torch.Tensor, starts: torch.Tensor, cache: Optional[SelectiveKVCache]) -> torch.Tensor:
        """``[b, s]`` bool: the tokens a threshold or window top-k student runs (no host read)."""
        if self.student_routing_mode == "threshold":
            selected = logits > self.student_logit_threshold
        else:
            selected = self.window_topk(logits, starts, cache)
        return selected | starts if self.always_run_first_token else selected

    def window_topk(self, logits: torch.Tensor, starts: torch.Tensor, cache: Optional[SelectiveKVCache]) -> torch.Tensor:
        """``[b, s]`` bool: tokens whose logit is in the top γ of their window (:func:`window_topk_mask`);
        with a cache the window continues from the scores it carries, and the cache then carries this
        chunk's last w − 1."""
        if cache is None:
            batch = logits.shape[0]
            recent = logits.new_zeros(batch, self.student_window - 1)
            recent_valid = torch.zeros_like(recent, dtype=torch.bool)
        else:
            recent, recent_valid = cache.recent_scores, cache.recent_scores_valid
        selected, recent, recent_valid = window_topk_mask(logits, starts, self.capacity, recent, recent_valid)
        if cache is not None:
            cache.carry_scores(recent, recent_valid)
        return selected

    def teacher_route(
        self, x, *, mask, input_pos, positions, starts, single_sequence, routing: RoutingContext, record: LayerRouting
    ) -> Tuple[Selection, Optional[torch.Tensor]]:
        """Variant-specific teacher decision: (selection, gate ``[b, s]``). Fills ``record``."""
        raise NotImplementedError

    def student_gate(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Gate applied at inference; None (= 1) unless the variant's gate is causal and scaled."""
        return None

    def skip_forecast(self, previous_outputs: torch.Tensor) -> torch.Tensor:
        """The forecast update ``[b, s, d]`` a skipped token receives with ``skip_update: predicted``, from
        the previous token's routed output at this layer (before its own forecast). Variant-specific."""
        raise NotImplementedError(f"{type(self).__name__} has no forecast of its update for skip_update='predicted'")

    def training_gate(self, gate: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The gate the routed pass applies in training, per ``gate`` (see the class docstring)."""
        if gate is None or self.gate == "scaled":
            return gate
        return (gate - gate.detach()) + 1.0  # exactly 1 forward, d/dgate = update

    def _add_skip_update(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        selection: Selection,
        starts: torch.Tensor,
        cache: Optional[SelectiveKVCache],
        every_row_skipped: Optional[bool],
    ) -> torch.Tensor:
        """``out [b, s, d]`` with the skip update (``skip_update``: forecast, bias or linear map of the input
        ``x [b, s, d]``) added to the tokens that ``selection`` skips; with a forecast, the routed output before
        it is handed to the cache first."""
        if self.skip_update == "predicted":
            # Token t's forecast reads token t−1's output without its own forecast: one parallel pass, causal.
            previous = previous_token_states(out, starts, None if cache is None else cache.last_output)
            if cache is not None:
                cache.carry_output(out)
            skipped = skipped_selection(selection)
            if every_row_skipped is not None:  # a decode step in which all rows skipped, or all ran
                return out + self.skip_forecast(previous) if every_row_skipped else out
            if skipped is None:
                return out + self.skip_forecast(previous) * (~selection.mask)[..., None].to(out.dtype)
            if skipped.num_selected:  # the forecast runs on the skipped tokens only
                return scatter_updates(out, skipped, self.skip_forecast(gather_tokens(previous, skipped.positions)))
        elif self.skip_update == "bias":
            if every_row_skipped is None:
                return out + self.skip_bias().to(out.dtype) * (~selection.mask)[..., None].to(out.dtype)
            if every_row_skipped:
                return out + self.skip_bias().to(out.dtype)
        elif self.skip_update == "linear":
            if every_row_skipped is not None:
                return out + self.skip_linear(x) if every_row_skipped else out
            skipped = skipped_selection(selection)
            if skipped is None:
                return out + self.skip_linear(x) * (~selection.mask)[..., None].to(out.dtype)
            if skipped.num_selected:  # the map runs on the skipped tokens only
                return scatter_updates(out, skipped, self.skip_linear(gather_tokens(x, skipped.positions)))
        return out

    def _skipped_token_update(
        self, x: torch.Tensor, starts: torch.Tensor, cache: SelectiveKVCache
    ) -> Optional[Callable[[], torch.Tensor]]:
        """For a branching decode step (one token): what computes the update ``[1, 1, d]`` a skipped token
        receives, called in the skip branch only; None with ``skip_update: none``. The forecast reads the
        previous token's routed output, which the cache carries (a one-token chunk has no other)."""
        if self.skip_update == "predicted":
            previous = previous_token_states(x, starts, cache.last_output)
            return lambda: self.skip_forecast(previous)
        if self.skip_update == "bias":
            return lambda: self.skip_bias().to(x.dtype)
        if self.skip_update == "linear":
            return lambda: self.skip_linear(x)
        return None

    # -- forward --------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        input_pos: Optional[torch.Tensor] = None,
        routing: Optional[RoutingContext] = None,
        **kwargs,
    ) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``[b, s, d]``.
            mask (Optional[torch.Tensor]): torchtune boolean mask ``[b, s, s]`` or, with caches,
                ``[b, s, max_cache_len]``; a batch dimension of 1 broadcasts over the rows.
            input_pos (Optional[torch.Tensor]): position ids (see :func:`token_positions`).
            routing (Optional[RoutingContext]): mode, β and the place to record statistics;
                student mode when None.

        Returns:
            torch.Tensor: ``[b, s, d]``.
        """
        routing = routing if routing is not None else RoutingContext(mode="student")
        batch, seq_len, _ = x.shape
        if routing.mode == "dense":
            if self._active_cache() is not None:
                raise RuntimeError("Dense routing mode runs the stock block, which cannot use the selective KV cache")
            out = _dense_forward(self, x, mask, input_pos)
            routing.file_record(self, LayerRouting(selected_mask=torch.ones(batch, seq_len, dtype=torch.bool, device=x.device)))
            return out
        if mask is not None:
            if not isinstance(mask, torch.Tensor):
                raise TypeError(
                    f"Routed layer {self.layer_idx} needs a dense boolean attention mask, got {type(mask).__name__}; "
                    "for packed data collate with torchtune_dtf.data.padded_collate_packed_dense"
                )
            if mask.shape[0] != batch:
                mask = mask.expand(batch, -1, -1)
        cache = self._active_cache()
        # Known from the arguments alone: with neither a mask nor position ids every row is one sequence.
        single_sequence = mask is None and input_pos is None
        if routing.token_layout is not None:  # the decoder's, for every routed layer of this forward
            positions, starts = routing.token_layout
        else:
            positions, starts = self.token_layout(mask, input_pos, batch, seq_len, x.device)
        # A compiled decode step of one row by a counted student (threshold, window top-k): run-or-skip is a
        # branch inside the graph (:func:`branching_decode_step`) instead of the host read of how many rows run.
        branching = (
            routing.mode == "student" and cache is not None and batch == 1 and seq_len == 1
            and self.student_routing_mode in _COUNTED_MODES and torch.compiler.is_compiling()
        )
        # The router's carried term is stored once the selection is made (below). A threshold or window top-k student
        # reads the device before that, which splits a compiled layer: the term is then read and overwritten in two
        # graphs and needs no copy; a graph that does both (a top-k student's, a branching decode step's) reads it
        # through one.
        reads_host = self.student_routing_mode in _COUNTED_MODES and not branching
        logits, carry = self.student_logits_and_carry(
            x, starts, cache, copy_carried=torch.compiler.is_compiling() and not reads_host
        )
        record = LayerRouting(student_logits=logits)

        if routing.mode == "teacher":
            if cache is not None:
                raise RuntimeError("Teacher routing is for training; disable or delete the KV caches first")
            selection, gate = self.teacher_route(
                x, mask=mask, input_pos=input_pos, positions=positions, starts=starts,
                single_sequence=single_sequence, routing=routing, record=record,
            )
            record.teacher_mask = selection.mask
            if self.causal_router is not None:
                record.causal_loss = F.binary_cross_entropy_with_logits(logits, selection.mask.float())
            with torch.no_grad():  # what the student runs, for agreement metrics and scheduled sampling
                if routing.execute == "teacher" and self.student_routing_mode in _COUNTED_MODES:
                    record.student_mask = self.student_mask(logits, starts, None)  # the mask only: no host read
                else:
                    student = self.student_selection(logits, starts, None, single_sequence=single_sequence, analysis=True)
                    record.student_mask = student.mask
            if routing.execute == "student":
                selection = student
            gate = self.training_gate(gate)
            every_row_skipped = None  # no cache, so no decode step's rows
        else:
            if self.student_routing_mode in _COUNTED_MODES and logits.numel():
                selected = self.student_mask(logits, starts, cache)
                # The forward's one host read (how many rows run a decode step; the largest and smallest row count
                # of a longer chunk), made in this frame rather than in a call below it: a compiled layer then splits
                # once, into the graph before the read and one graph per count after it. Read in
                # student_selection, every frame down to the read split too (five graphs per decode step).
                # ``tolist``: dynamo answers ``int()`` of a tensor with a warning that advises capturing scalars.
                if branching:
                    # Compiled, one row: the block runs or not by a branch on the device (no read, one graph).
                    selection = Selection(positions=positions.new_zeros(1, 1), valid=None, mask=selected)
                elif cache is not None and seq_len == 1:
                    selection = row_selection(selected, selected.sum().tolist())
                else:
                    selection = mask_selection(selected, row_count_extremes(selected).tolist())
            else:
                selection = self.student_selection(logits, starts, cache, single_sequence=single_sequence)
            if carry is not None:
                cache.carry_router_term(carry)
            # A decode step in which no row runs the block applies no update, so it needs no gate (MoD's would
            # be a router product and a sigmoid per skipped token).
            every_row_skipped = _every_row_skipped(selection, batch)
            gate = None if every_row_skipped else self.student_gate(x)

        # Filed before the block runs: dynamo (torch 2.13) drops attribute writes made after a torch.cond to an
        # object created in the same graph, so after ``branching_decode_step`` this record would keep None.
        record.selected_mask = selection.mask
        if branching:
            # The skip update goes into the branch the token takes: a token that runs the block never computes
            # the forecast (or adds the bias) only to have it masked away.
            out = branching_decode_step(
                self,
                x,
                selection.mask,
                gate if routing.apply_gate else None,
                positions=positions,
                mask=mask,
                cache=cache,
                skipped_tokens_write_kv=self.skipped_tokens_write_kv,
                skipped_update=self._skipped_token_update(x, starts, cache),
            )
            if self.skip_update == "predicted":
                # The next token's forecast reads this one's output before its own forecast: the block's output
                # when it ran, its input when it skipped.
                cache.carry_output(torch.where(selection.mask[..., None], out, x))
        else:
            out = routed_block_forward(
                self,
                x,
                selection,
                gate if routing.apply_gate else None,
                positions=positions,
                mask=mask,
                cache=cache,
                skipped_tokens_write_kv=self.skipped_tokens_write_kv,
            )
            out = self._add_skip_update(x, out, selection, starts, cache, every_row_skipped)
        if cache is not None:
            cache.advance(x)
        if routing.mode == "student":  # the deployed router only (see routing_counts)
            self._count_student(selection.mask)
        routing.file_record(self, record)
        return out


class MoDLayer(RoutedSelfAttentionLayer):
    """Mixture-of-Depths layer: top-k of a linear router's scores, update scaled by σ(r) (paper eq. 4).

    Args:
        mod_router (MoDRouter): r_t = w·x_t.
        **kwargs: see :class:`RoutedSelfAttentionLayer`.
    """

    def __init__(self, attn, mlp, *, mod_router: MoDRouter, **kwargs) -> None:
        super().__init__(attn, mlp, **kwargs)
        self.mod_router = mod_router

    def teacher_route(self, x, *, mask, input_pos, positions, starts, single_sequence, routing, record):
        scores = self.mod_router(x)
        record.router_logits = scores
        selection = self.topk_by_sequence(scores, starts, routing.capacity(self.capacity), single_sequence=single_sequence)
        return selection, torch.sigmoid(scores)

    def student_gate(self, x):
        # The MoD router is per-token, hence causal: its gate is available at inference too.
        return torch.sigmoid(self.mod_router(x)) if self.gate == "scaled" else None


class RandomRoutedLayer(RoutedSelfAttentionLayer):
    """Random routing, a baseline at the routed variants' budget: no router and no gate.

    Each forward draws u ~ U(0, 1) per token (torch's global generator, so a seeded run is reproducible).
    In training the teacher runs the per-sequence top-⌊γ·n⌋ of u — exactly the routed variants' budget —
    and inference runs the causal rule u > 1 − γ, which executes γ of the tokens in expectation.

    Args:
        skip_update (str): ``"none"``, ``"bias"`` or ``"linear"`` (see :class:`RoutedSelfAttentionLayer`).
        **kwargs: see :class:`RoutedSelfAttentionLayer` (without the student and gate arguments).
    """

    def __init__(self, attn, mlp, *, capacity: float, skip_update: str, **kwargs) -> None:
        if skip_update == "predicted":
            raise ValueError("random routing has no forecast of the block's update; skip_update must be 'none', "
                             "'bias' or 'linear'")
        super().__init__(
            attn,
            mlp,
            capacity=capacity,
            causal_router=None,
            student_routing_mode="threshold",
            student_threshold=1.0 - capacity,
            student_window=None,
            gate="scaled",  # no gate exists; the update is applied at 1
            allow_noncausal_student_topk=False,
            skip_update=skip_update,
            **kwargs,
        )

    def student_logits_and_carry(self, x, starts, cache, *, copy_carried):
        # logit(u) for u ~ U(0, 1): σ(logit) > 1 − γ ⟺ u > 1 − γ, and top-k of it is a random top-k. Nothing to carry.
        u = torch.rand(x.shape[:2], device=x.device, dtype=torch.float32).clamp(min=1e-12, max=1 - 1e-7)
        return torch.log(u) - torch.log1p(-u), None

    def teacher_route(self, x, *, mask, input_pos, positions, starts, single_sequence, routing, record):
        capacity = routing.capacity(self.capacity)
        return self.topk_by_sequence(record.student_logits, starts, capacity, single_sequence=single_sequence), None


class DroppedLayer(TransformerSelfAttentionLayer):
    """A layer removed by static layer dropping (a baseline): it runs on no token.

    Its weights stay (same keys, so the pretrained checkpoint loads 1:1) but take no part in the forward.
    With ``skip_bias`` (``skip_update: bias``) every token receives that learned constant update instead:
    ``x + b``; with ``skip_linear`` (``skip_update: linear``) the affine map of its input, ``x + W·rms(x) + b``.
    Shapes ``[b, s, d]`` → ``[b, s, d]``."""

    def __init__(
        self, attn, mlp, *, sa_norm, mlp_norm, skip_bias: Optional[SkipBias] = None,
        skip_linear: Optional[SkipLinear] = None,
    ) -> None:
        super().__init__(attn=attn, mlp=mlp, sa_norm=sa_norm, mlp_norm=mlp_norm)
        if skip_bias is not None and skip_linear is not None:
            raise ValueError("a dropped layer takes a skip bias or a skip linear map, not both")
        # None: no child, so the state dict keeps the dense keys
        self.skip_bias = skip_bias
        self.skip_linear = skip_linear

    def setup_caches(
        self, batch_size: int, dtype: torch.dtype, *, encoder_max_seq_len: int, decoder_max_seq_len: int
    ) -> None:
        """A one-entry placeholder instead of a ``decoder_max_seq_len`` cache: the layer never attends, so it
        stores nothing, but torchtune's cache helpers (``caches_are_setup``, ``reset_caches``,
        ``disable_kv_cache``, ``delete_kv_caches``) find a cache as on every other layer."""
        self.attn.setup_cache(batch_size, dtype, max_seq_len=1)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        # Nothing but the one add or map (a decode step runs this per dropped layer): no cache, no conversion.
        if self.skip_linear is not None:
            return x + self.skip_linear(x)
        if self.skip_bias is None:
            return x
        bias = self.skip_bias()
        return x + (bias if bias.dtype == x.dtype else bias.to(x.dtype))


class _SurpriseRoutedLayer(RoutedSelfAttentionLayer):
    """Shared teacher logic of SDT Dynamic and STT layers: surprise → g → selection.

    Args:
        predictive_router (PredictiveRouter): o_ce, m_cu, MA window.
        teacher_selection (str): ``"topk"`` (fixed capacity) or ``"threshold"`` (g ≥ g_th, dynamic capacity).
        gate_threshold (Optional[float]): g_th for threshold selection.
    """

    def __init__(
        self,
        attn,
        mlp,
        *,
        predictive_router: PredictiveRouter,
        teacher_selection: str,
        gate_threshold: Optional[float],
        **kwargs,
    ) -> None:
        super().__init__(attn, mlp, **kwargs)
        if teacher_selection not in TEACHER_SELECTIONS:
            raise ValueError(f"Unknown teacher_selection {teacher_selection!r}")
        self.predictive_router = predictive_router
        self.teacher_selection = teacher_selection
        self.gate_threshold = gate_threshold
        self._gate_threshold_score = gate_threshold_score(gate_threshold) if teacher_selection == "threshold" else None

    def residuals(self, x, *, mask, input_pos, starts, routing) -> Tuple[torch.Tensor, torch.Tensor]:
        """(true residual Δx without gradient, predicted residual Δx̂), each ``[b, s, d]``."""
        raise NotImplementedError

    def teacher_route(self, x, *, mask, input_pos, positions, starts, single_sequence, routing, record):
        beta_ce, beta_cu = routing.betas()
        delta, predicted = self.residuals(x, mask=mask, input_pos=input_pos, starts=starts, routing=routing)
        d_st = static_surprise(delta)
        d_ch = change_surprise(delta, predicted)
        surprise = self.predictive_router(d_st, d_ch, beta_ce, beta_cu, starts)
        # Rank by the non-saturating score, never by g itself (docs/design.md R1); g stays the gate.
        if self.teacher_selection == "topk":
            capacity = routing.capacity(self.capacity)
            selection = self.topk_by_sequence(surprise.score, starts, capacity, single_sequence=single_sequence)
        else:
            selection = self.by_threshold(surprise.score >= self._gate_threshold_score, starts)
        record.score = surprise.score
        record.d_st, record.d_ch = d_st, d_ch
        record.ce, record.cu, record.s_ce, record.s_cu, record.g = (
            surprise.ce, surprise.cu, surprise.s_ce, surprise.s_cu, surprise.g,
        )
        record.o_ce = self.predictive_router.o_ce.detach()
        record.m_cu = self.predictive_router.m_cu.detach()
        # MSE(Δx̂, stop_grad(Δx)) averaged over d and tokens is the mean change surprise.
        record.pred_loss = d_ch.mean()
        record.g_mean = surprise.g.mean()
        return selection, surprise.g


class STTLayer(_SurpriseRoutedLayer):
    """Subjective Timescale layer (paper §3.2; spec §4; docs/design.md §3.6).

    Teacher: a dense pass of the block without gradient gives Δx_t; the TPN predicts it from the previous
    token's dense output state x_{t−1}^(l) (x_0 = 0); surprise → g → top-k (or g ≥ g_th); the block then
    runs on the selected tokens only and the LM loss flows through that routed pass ("mixed mode").

    Args:
        transition (ResidualPredictor): the TPN.
        **kwargs: see :class:`_SurpriseRoutedLayer`.
    """

    def __init__(self, attn, mlp, *, transition: ResidualPredictor, **kwargs) -> None:
        super().__init__(attn, mlp, **kwargs)
        self.transition = transition

    def residuals(self, x, *, mask, input_pos, starts, routing):
        with torch.no_grad():
            dense_out = _dense_forward(self, x, mask, input_pos)
            delta = dense_out - x
        predicted = self.transition(previous_token_states(dense_out, starts))
        return delta, predicted

    def skip_forecast(self, previous_outputs: torch.Tensor) -> torch.Tensor:
        # The TPN's predicted change Δx̂_t = TPN(x_{t−1}^(l)): the "expected change" of the surprise story.
        return self.transition(previous_outputs)


class SDTDynamicLayer(_SurpriseRoutedLayer):
    """SDT Dynamic layer (paper §3.1.2): routes its own block with g computed from the residuals that the
    preceding :class:`SDTDecisionLayer` produced."""

    def residuals(self, x, *, mask, input_pos, starts, routing):
        states = routing.states_from_previous_layer(self)
        if states is None:
            raise RuntimeError(
                f"SDT Dynamic layer {self.layer_idx} found no Decision-layer states; layer {self.layer_idx - 1} "
                "must be an SDTDecisionLayer run with the same RoutingContext"
            )
        return states


class SDTDecisionLayer(TransformerSelfAttentionLayer):
    """SDT Decision layer (paper §3.1.1): a full standard block plus a PriorFFN.

    In teacher mode it hands the Dynamic layer at ``layer_idx + 1`` the true residual
    Δx = x_post − x_orig (no gradient; the backbone is not pulled by routing) and the prior's prediction
    Δx̂ = PriorFFN(x_orig) (eq. 7). In student mode it is exactly the standard layer.

    Args:
        prior_ffn (ResidualPredictor): the PriorFFN.
        layer_idx (int): index of this layer.
    """

    def __init__(self, attn, mlp, *, sa_norm, mlp_norm, prior_ffn: ResidualPredictor, layer_idx: int) -> None:
        super().__init__(attn=attn, mlp=mlp, sa_norm=sa_norm, mlp_norm=mlp_norm)
        self.prior_ffn = prior_ffn
        self.layer_idx = layer_idx

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        input_pos: Optional[torch.Tensor] = None,
        routing: Optional[RoutingContext] = None,
        **kwargs,
    ) -> torch.Tensor:
        out = super().forward(x, mask=mask, input_pos=input_pos)
        if routing is not None and routing.mode == "teacher":
            delta = (out - x).detach()
            routing.hand_to_next_layer(self, (delta, self.prior_ffn(x.detach())))
        return out
