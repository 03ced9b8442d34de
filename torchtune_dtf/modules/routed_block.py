"""Run a torchtune ``TransformerSelfAttentionLayer``'s weights on a selection of tokens.

This is the one executor every variant shares (docs/design.md §9): the variants differ only in how they decide
(selection, gate). For each batch row it

1. gathers the selected tokens in time order (``[b, k, d]``), keeping their original positions for RoPE;
2. runs pre-norm attention where a selected token attends only to selected tokens of the same row at or
   before it (skipped tokens are neither keys nor values here; rows never see each other — docs/design.md §3.7);
   with a :class:`SelectiveKVCache`, the gathered tokens' K/V are appended to the row's cache first and
   the queries attend over the row's stored entries. With ``skipped_tokens_write_kv`` (context-preserving
   attention) every token computes and stores its K/V and the selected queries attend over all of them;
3. runs the MLP, and forms the block's update Δ = attn_out + mlp_out;
4. scales Δ by the gate (attention and MLP together, docs/design.md §3.5) and adds it back at the selected
   positions: x_t ← x_t + g_t·Δ_t; skipped tokens pass unchanged.

Only the selected tokens are computed, so the work is k/s of the dense block's linear work and (k/s)² of
its attention scores. Attention through an explicit mask (ragged selections, packed documents, and every
``skipped_tokens_write_kv`` layer, whose k selected queries attend over all s keys) would make the kernel compute
the whole score rectangle, masked half included. Instead the queries, in time order, are cut into a few chunks
(:func:`query_chunks`) and each chunk attends only to the keys up to the last one any of its queries may see
(:func:`chunk_key_bounds`): the staircase under the causal diagonal, in steps, not the rectangle.

Shapes: with a top-k selection every shape here is static (k slots per row, or ⌊γ·b⌋ rows of a decode step) and
nothing is read back from the device, so ``torch.compile(fullgraph=True)`` captures the whole layer. A compiled
graph cannot know the chunks' exact key bounds; in inference it hands the chunks to one opaque operator
(:func:`selected_attention_by_chunks`), whose CPU kernel reads them (host memory: nothing to wait for) and whose
kernel on other devices keeps a bound that holds for every selection.
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torchtune.modules import TransformerSelfAttentionLayer

from torchtune_dtf.modules.selection import Selection, gather_tokens, scatter_updates
from torchtune_dtf.modules.selective_kv_cache import SelectiveKVCache


def _project_queries(layer: TransformerSelfAttentionLayer, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q ``[b, n_h, k, h_d]`` (RoPE and q-norm applied) for normed inputs ``h [b, k, d]``."""
    attn = layer.attn
    b, k, _ = h.shape
    q = attn.q_proj(h).view(b, k, attn.num_heads, attn.head_dim)
    if attn.pos_embeddings is not None:
        q = attn.pos_embeddings(q, input_pos=positions)
    q = q.transpose(1, 2)
    return attn.q_norm(q) if attn.q_norm is not None else q


def _project_keys_values(layer: TransformerSelfAttentionLayer, h: torch.Tensor, positions: torch.Tensor):
    """k and v ``[b, n_kv, k, h_d]`` (RoPE and k-norm on k) for normed inputs ``h [b, k, d]``."""
    attn = layer.attn
    b, k, _ = h.shape
    key = attn.k_proj(h).view(b, k, attn.num_kv_heads, attn.head_dim)
    value = attn.v_proj(h).view(b, k, attn.num_kv_heads, attn.head_dim)
    if attn.pos_embeddings is not None:
        key = attn.pos_embeddings(key, input_pos=positions)
    key, value = key.transpose(1, 2), value.transpose(1, 2)
    return (attn.k_norm(key) if attn.k_norm is not None else key), value


def _attention_mask(
    mask: Optional[torch.Tensor],
    query_index: torch.Tensor,
    query_slots: torch.Tensor,
    key_slots: torch.Tensor,
    key_valid: Optional[torch.Tensor],
) -> torch.Tensor:
    """Boolean mask ``[r, 1, k, n]`` (True = attend) for gathered queries over gathered/cached keys.

    Args:
        mask: the caller's mask ``[r, s, L]`` over the current chunk's tokens and layout slots, or None for
            plain causality by slot.
        query_index: ``[r, k]`` index of each query inside the current chunk.
        query_slots: ``[r, k]`` layout slot of each query.
        key_slots: ``[r, n]`` layout slot of each key.
        key_valid: ``[r, n]`` False for keys that do not exist (padding), or None.
    """
    if mask is None:
        allowed = key_slots[:, None, :] <= query_slots[:, :, None]
    else:
        if mask.shape[1] == 1:  # a chunk of one token (a decode step): every query is that token, its one mask row
            rows_of_queries = mask.expand(-1, query_index.shape[1], -1)
        else:
            rows_of_queries = torch.gather(mask, 1, query_index[..., None].expand(-1, -1, mask.shape[-1]))
        allowed = torch.gather(rows_of_queries, 2, key_slots[:, None, :].expand(-1, query_index.shape[1], -1))
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :]
    return allowed[:, None]


# A chunk of queries is one attention call; fewer than this many queries per call and the calls' own cost
# outweighs the masked keys they skip. At most this many chunks, so a long prefill stays a few calls.
_MIN_QUERIES_PER_CHUNK = 64
_MAX_QUERY_CHUNKS = 8


def query_chunks(num_queries: int) -> List[Tuple[int, int]]:
    """Split ``num_queries`` time-ordered queries into up to 8 contiguous ``(start, end)`` chunks of about
    equal size, each of at least 64 queries (one chunk when there are fewer than 128)."""
    count = min(_MAX_QUERY_CHUNKS, num_queries // _MIN_QUERIES_PER_CHUNK)
    if count <= 1:
        return [(0, num_queries)]
    size = -(-num_queries // count)
    return [(start, min(start + size, num_queries)) for start in range(0, num_queries, size)]


def chunk_key_bounds(
    chunks: List[Tuple[int, int]],
    last_key: torch.Tensor,
    valid: Optional[torch.Tensor],
    num_keys: int,
    static_bounds: Optional[List[int]],
) -> List[int]:
    """How many keys (a prefix of the key axis) each chunk of queries attends over.

    Keys are in slot order and every query sees only keys at or before its own slot (causal masks, packed or
    padded, only remove keys from that), so a chunk needs the keys up to the largest ``last_key`` of its real
    queries, over all rows. Eager code reads that from the device (one host read for all chunks); compiled code
    cannot read without a graph break, so it takes ``static_bounds``, a bound that holds for every selection
    of this shape, or all keys when there is none (and, where it may, reads the exact bounds inside an opaque
    operator instead: :func:`selected_attention_by_chunks`).

    Args:
        chunks: from :func:`query_chunks`.
        last_key (torch.Tensor): ``[r, k]`` index along the key axis of the last key each query may see.
        valid (Optional[torch.Tensor]): ``[r, k]`` False for padding queries (their keys do not matter).
        num_keys (int): length of the key axis.
        static_bounds (Optional[List[int]]): per chunk, a data-independent bound, or None.

    Returns:
        List[int]: per chunk, in ``[1, num_keys]``.
    """
    if len(chunks) == 1:
        return [num_keys]
    if torch.compiler.is_compiling():
        return static_bounds if static_bounds is not None else [num_keys] * len(chunks)
    return _read_key_bounds([end for _, end in chunks], _real_last_keys(last_key, valid), num_keys)


def _real_last_keys(last_key: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """``last_key [r, k]`` with padding queries' entries at key 0 (their keys do not matter)."""
    return last_key if valid is None else torch.where(valid, last_key, torch.zeros_like(last_key))


def _exact_key_bounds(chunk_ends: List[int], last_key: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[C]`` per chunk of queries the number of keys it needs, in ``[1, num_keys]``, on ``last_key``'s device."""
    # Real queries are ascending and come first in each row, so a running maximum at a chunk's last query is
    # the chunk's largest real key (or an earlier one, for a chunk of padding only).
    running = torch.cummax(last_key, dim=1).values
    ends = torch.tensor([end - 1 for end in chunk_ends], device=last_key.device)
    return (running.index_select(1, ends).amax(dim=0) + 1).clamp(1, num_keys)


def _operator_key_bounds(chunk_ends: List[int], last_key: torch.Tensor, num_keys: int) -> torch.Tensor:
    """What :func:`selected_attention_by_chunks` is given as ``key_bounds``: the exact counts on the CPU, whose
    kernel reads them, and an empty tensor elsewhere, whose kernel keeps the static bounds, so a GPU graph does
    not compute counts nobody reads. (A traced graph knows its tensors' device, so this costs no guard beyond
    the device's.)"""
    if last_key.device.type == "cpu":
        return _exact_key_bounds(chunk_ends, last_key, num_keys)
    return last_key.new_empty(0)


def _read_key_bounds(chunk_ends: List[int], last_key: torch.Tensor, num_keys: int) -> List[int]:
    """The exact per-chunk key counts, read from the device in one transfer."""
    return _exact_key_bounds(chunk_ends, last_key, num_keys).tolist()


def _attention_by_chunks(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    chunks: List[Tuple[int, int]],
    key_bounds: List[int],
    dropout_p: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """``q [r, n_h, k, h_d]``, chunk by chunk, each over its prefix of ``key``/``value [r, n_kv, n, h_d]``
    through ``attn_mask [r, 1, k, n]`` (or causally) → ``[r, n_h, k, h_d]``. A boolean mask is given a key in every
    row of each chunk here; an additive one comes with a key in every row already."""
    # Neighbouring chunks over the same keys (no bound known, or equal bounds) are one call.
    merged: List[Tuple[int, int, int]] = []
    for (start, end), num_keys in zip(chunks, key_bounds):
        if merged and merged[-1][2] == num_keys:
            merged[-1] = (merged[-1][0], end, num_keys)
        else:
            merged.append((start, end, num_keys))
    outputs = []
    for start, end, num_keys in merged:
        chunk_mask = None
        if attn_mask is not None:
            chunk_mask = attn_mask[:, :, start:end, :num_keys]
            if chunk_mask.dtype == torch.bool:
                # A padding query may have no key at all; give it every key so softmax stays finite (its output
                # is discarded on scatter).
                chunk_mask = chunk_mask | ~chunk_mask.any(dim=-1, keepdim=True)
        outputs.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end],
                key[:, :, :num_keys],
                value[:, :, :num_keys],
                attn_mask=chunk_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                enable_gqa=enable_gqa,
            )
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


@torch.library.custom_op("torchtune_dtf::selected_attention_by_chunks", mutates_args=())
def selected_attention_by_chunks(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor,
    key_bounds: torch.Tensor,
    chunk_ends: List[int],
    static_bounds: List[int],
    enable_gqa: bool,
) -> torch.Tensor:
    """Inference attention of selected queries by chunks, as one operator a compiled graph calls without looking
    inside: on the CPU each chunk attends over its exact number of keys, read from ``key_bounds [C]``; on any other
    device over ``static_bounds``.

    A graph cannot read the selected positions without breaking, so compiled code bounds each chunk's keys by
    the worst case over all selections (:func:`chunk_key_bounds`), which for a b1 × 1024 prefill at γ = ½ with
    every token's K/V kept does ≈ 1.3× the exact chunks' attention work (``benchmarks/selected_attention.py``).
    Inside an operator the graph treats as opaque, the read costs nothing on the CPU, where there is no device
    to wait for; on a GPU it would be a synchronisation per layer and would keep the step out of a CUDA graph,
    so this kernel (the default, for every device but the CPU) keeps the static bounds.

    Args:
        q, key, value: as :func:`_attention_by_chunks`.
        attn_bias (torch.Tensor): ``[r, 1, k, n]`` additive mask in ``q``'s dtype (0 or −∞), every row with a key.
        key_bounds (torch.Tensor): ``[C]`` per chunk the exact number of keys (:func:`_exact_key_bounds`) on the
            CPU; empty on other devices, whose kernel does not read it (:func:`_operator_key_bounds`).
        chunk_ends (List[int]): per chunk its end along the queries (chunks are contiguous from 0).
        static_bounds (List[int]): per chunk, a bound that holds for every selection of this shape.
        enable_gqa (bool): as in ``scaled_dot_product_attention``.
    """
    chunks = list(zip([0] + chunk_ends[:-1], chunk_ends))
    return _attention_by_chunks(q, key, value, attn_bias, False, chunks, static_bounds, 0.0, enable_gqa)


@selected_attention_by_chunks.register_kernel("cpu")
def _selected_attention_by_chunks_cpu(q, key, value, attn_bias, key_bounds, chunk_ends, static_bounds, enable_gqa):
    chunks = list(zip([0] + chunk_ends[:-1], chunk_ends))
    return _attention_by_chunks(q, key, value, attn_bias, False, chunks, key_bounds.tolist(), 0.0, enable_gqa)


@selected_attention_by_chunks.register_fake
def _(q, key, value, attn_bias, key_bounds, chunk_ends, static_bounds, enable_gqa):
    return q.new_empty(*q.shape[:-1], value.shape[-1])


def routed_block_forward(
    layer: TransformerSelfAttentionLayer,
    x: torch.Tensor,
    selection: Selection,
    gate: Optional[torch.Tensor],
    *,
    positions: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    cache: Optional[SelectiveKVCache] = None,
    skipped_tokens_write_kv: bool = False,
) -> torch.Tensor:
    """Apply ``layer``'s block to the selected tokens of ``x`` only.

    Args:
        layer (TransformerSelfAttentionLayer): supplies attn, mlp, norms and scales.
        x (torch.Tensor): ``[b, s, d]`` layer input.
        selection (Selection): which tokens run, per row.
        gate (Optional[torch.Tensor]): ``[b, s]`` per-token gate scaling the update; None means 1.
        positions (torch.Tensor): ``[b, s]`` position ids (RoPE) of the tokens of ``x``.
        mask (Optional[torch.Tensor]): ``[b, s, s]`` (no cache) or ``[b, s, max_cache_len]`` (cache) boolean
            mask in torchtune's convention; None means causal.
        cache (Optional[SelectiveKVCache]): per-row cache; when given, selected tokens' K/V are stored and
            queries attend over the stored entries.
        skipped_tokens_write_kv (bool): context-preserving attention: every token, run or skipped, computes
            its k/v projections (2·d·2·n_kv·h_d FLOPs, no MLP, no query) and is a key/value for the
            selected queries (and is stored in the cache); only the selected tokens get an update. The
            layer's K/V memory is then the dense layer's.

    Returns:
        torch.Tensor: ``[b, s, d]`` layer output.
    """
    if skipped_tokens_write_kv:
        return _forward_with_all_keys(layer, x, selection, gate, positions=positions, mask=mask, cache=cache)
    if selection.num_selected == 0:
        return x
    # Decoding: rows that run nothing this step are left out of the computation entirely.
    rows = selection.rows
    if rows is not None and rows.shape[0] == 0:
        return x
    rows = _fewer_rows(rows, x.shape[0])
    x_rows = x if rows is None else x[rows]
    positions = positions if rows is None else positions[rows]
    mask = mask if (rows is None or mask is None) else mask[rows]
    query_index = selection.positions
    valid = selection.valid

    if _one_token_per_row(selection, x):
        xs, query_positions = x_rows, positions  # each row's one token is the selected one
    else:
        xs, query_positions = gather_tokens(x_rows, query_index), gather_tokens(positions, query_index)
    h = layer.sa_norm(xs)
    q = _project_queries(layer, h, query_positions)
    key, value = _project_keys_values(layer, h, query_positions)

    attn_mask, is_causal, last_key = None, False, None
    chunks = query_chunks(query_index.shape[1])
    if cache is not None:
        query_slots = cache.layout_slots(query_index)
        # A query's last key is its own entry (the cache stores entries in time order).
        last_entry = cache.append(rows, key, value, query_slots, valid)
        key, value, key_slots, key_valid = cache.entries(rows)
        attn_mask = _attention_mask(mask, query_index, query_slots, key_slots, key_valid)
        key_bounds = chunk_key_bounds(chunks, last_entry, valid, key.shape[2], static_bounds=None)
        last_key = _real_last_keys(last_entry, valid)
    elif mask is None and valid is None:
        is_causal = True  # gathered in time order, so causality among them is the lower triangle
        chunks, key_bounds = [(0, query_index.shape[1])], [query_index.shape[1]]
    else:
        attn_mask = _attention_mask(mask, query_index, query_index, query_index, valid)
        key_bounds = [end for _, end in chunks]  # the keys are the queries themselves, in the same order

    gate_rows = gate if (rows is None or gate is None) else gate[rows]
    out_rows = _attend_and_update(
        layer, x_rows, xs, q, key, value, selection, gate_rows, attn_mask, is_causal, chunks, key_bounds, last_key
    )
    if rows is None:
        return out_rows
    return x.index_copy(0, rows, out_rows)


def branching_decode_step(
    layer: TransformerSelfAttentionLayer,
    x: torch.Tensor,
    runs: torch.Tensor,
    gate: Optional[torch.Tensor],
    *,
    positions: torch.Tensor,
    mask: Optional[torch.Tensor],
    cache: SelectiveKVCache,
    skipped_tokens_write_kv: bool,
    skipped_update: Optional[Callable[[], torch.Tensor]] = None,
) -> torch.Tensor:
    """A batch-1 decode step whose token runs the block or skips it as the device decides, without a host read.

    A threshold or window top-k student decides per token, so at batch 1 a decode step either runs the whole
    block or none of it. :func:`routed_block_forward` learns which from the host (the running rows' count), which
    splits a compiled layer into a graph before the read and one per answer after it. Here the choice is a
    ``torch.cond`` inside one graph (compiled code only; eager code keeps the read, which costs nothing on the
    CPU): its running branch projects the query and runs attention and the MLP, so a skipped token still reads
    none of those weights. Branches may not write to the cache, so the token's K/V are computed before the
    branch and stored by the device's choice (``runs`` as the write's validity: a skipped token's write goes
    to the scratch entry and leaves the fill as it was), unless skipped tokens keep their K/V anyway. That costs a
    skipped token the k/v projections (2·d·n_kv·h_d weights, ≈ 1.5 % of a Qwen2.5-0.5B block) that
    :func:`routed_block_forward` would not compute.

    Args:
        layer (TransformerSelfAttentionLayer): supplies attn, mlp, norms and scales.
        x (torch.Tensor): ``[1, 1, d]`` the step's token.
        runs (torch.Tensor): ``[1, 1]`` bool, True when the token runs the block.
        gate (Optional[torch.Tensor]): ``[1, 1]`` gate of the update, or None for 1.
        positions (torch.Tensor): ``[1, 1]`` the token's position id.
        mask (Optional[torch.Tensor]): ``[1, 1, max_cache_len]`` boolean mask over layout slots, or None (causal).
        cache (SelectiveKVCache): the layer's cache.
        skipped_tokens_write_kv (bool): every token stores its K/V (context-preserving attention).
        skipped_update (Optional[Callable[[], torch.Tensor]]): computes the update ``[1, 1, d]`` a skipped token
            receives (the layer's skip bias or forecast), called in the skip branch only, so a token that runs
            the block does not compute it; None: a skipped token leaves as it came.

    Returns:
        torch.Tensor: ``[1, 1, d]``.
    """
    if x.shape[:2] != (1, 1) or runs.shape != (1, 1):
        raise ValueError(f"branching_decode_step takes one token of one row, got x {list(x.shape)}, runs {list(runs.shape)}")
    h = layer.sa_norm(x)
    key, value = _project_keys_values(layer, h, positions)
    query_index = torch.zeros_like(positions)
    query_slots = cache.layout_slots(query_index)
    cache.append(None, key, value, query_slots, None if skipped_tokens_write_kv else runs)
    keys, values, key_slots, key_valid = cache.entries(None)
    one_token = Selection(positions=query_index, valid=None, mask=runs)

    def run_block(x, h, positions, keys, values, key_slots, key_valid):
        q = _project_queries(layer, h, positions)
        attn_mask = _attention_mask(mask, query_index, query_slots, key_slots, key_valid)
        return _attend_and_update(
            layer, x, x, q, keys, values, one_token, gate, attn_mask, False, [(0, 1)], [keys.shape[2]]
        )

    def skip_block(x, h, positions, keys, values, key_slots, key_valid):
        if skipped_update is None:
            return x.clone()  # a branch may not return its input itself
        return x + skipped_update()

    return torch.cond(runs.view(()), run_block, skip_block, (x, h, positions, keys, values, key_slots, key_valid))


def _fewer_rows(rows: Optional[torch.Tensor], batch: int) -> Optional[torch.Tensor]:
    """A decode step's running ``rows`` when they are fewer than the ``batch``; None when every row runs (the
    rows are ascending and distinct, so all ``batch`` of them are every row in order): the rows' tensors are
    then the batch's own, no copy gathered and none copied back."""
    return rows if rows is not None and rows.shape[0] < batch else None


def _one_token_per_row(selection: Selection, x: torch.Tensor) -> bool:
    """True when each row of ``x [r, 1, d]`` selects its only token (a decode step): gathering the selected
    tokens returns the tensors themselves, so the gathers are skipped."""
    return x.shape[1] == 1 and selection.num_selected == 1 and selection.valid is None


def _forward_with_all_keys(
    layer: TransformerSelfAttentionLayer,
    x: torch.Tensor,
    selection: Selection,
    gate: Optional[torch.Tensor],
    *,
    positions: torch.Tensor,
    mask: Optional[torch.Tensor],
    cache: Optional[SelectiveKVCache],
) -> torch.Tensor:
    """:func:`routed_block_forward` with ``skipped_tokens_write_kv``: keys/values from every token of
    every row, queries, MLP and update from the selected tokens only."""
    batch, seq_len, _ = x.shape
    h_all = layer.sa_norm(x)
    key, value = _project_keys_values(layer, h_all, positions)
    slots = torch.arange(seq_len, device=x.device).expand(batch, seq_len)
    key_valid = None
    if cache is not None:
        slots = cache.layout_slots(slots)
        cache.append(None, key, value, slots)  # every row
    if selection.num_selected == 0:
        return x
    if selection.rows is not None and selection.rows.shape[0] == 0:
        return x
    rows = _fewer_rows(selection.rows, batch)
    if rows is not None:  # decoding: queries, MLP and update of the rows that run only
        x_rows, h_rows, positions = x[rows], h_all[rows], positions[rows]
        mask = None if mask is None else mask[rows]
        gate = None if gate is None else gate[rows]
    else:
        x_rows, h_rows = x, h_all
    if cache is not None:
        key, value, slots, key_valid = cache.entries(rows)
    query_index = selection.positions
    if _one_token_per_row(selection, x):
        xs, q = x_rows, _project_queries(layer, h_rows, positions)  # each row's one token is the selected one
    else:
        xs = gather_tokens(x_rows, query_index)
        q = _project_queries(layer, gather_tokens(h_rows, query_index), gather_tokens(positions, query_index))
    query_slots = query_index if cache is None else cache.layout_slots(query_index)
    attn_mask = _attention_mask(mask, query_index, query_slots, slots, key_valid)
    # Every token of every row is a key, stored in slot order, so a query's last key is at its own slot.
    num_queries, num_keys = query_index.shape[1], key.shape[2]
    chunks = query_chunks(num_queries)
    static_bounds = None
    if cache is None and selection.valid is None:
        # k ascending distinct positions among n: the i-th is at most n − k + i, whatever was selected.
        static_bounds = [num_keys - num_queries + end for _, end in chunks]
    key_bounds = chunk_key_bounds(chunks, query_slots, selection.valid, num_keys, static_bounds)
    out_rows = _attend_and_update(
        layer, x_rows, xs, q, key, value, selection, gate, attn_mask, False, chunks, key_bounds,
        _real_last_keys(query_slots, selection.valid),
    )
    return out_rows if rows is None else x.index_copy(0, rows, out_rows)


def _attend_and_update(
    layer: TransformerSelfAttentionLayer,
    x: torch.Tensor,
    xs: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selection: Selection,
    gate: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    chunks: List[Tuple[int, int]],
    key_bounds: List[int],
    last_key: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of the selected queries (chunk by chunk, each over its prefix of the keys), the MLP, and the
    gated update added back into ``x [b, s, d]``. ``last_key [r, k]``: each query's last key (padding at 0),
    when the chunks' bounds depend on the selection; compiled inference then reads them inside
    :func:`selected_attention_by_chunks`."""
    attn = layer.attn
    enable_gqa = attn.num_heads != attn.num_kv_heads
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, key, value))
    if (
        last_key is not None and attn_mask is not None and len(chunks) > 1
        and torch.compiler.is_compiling() and not needs_grad
    ):
        # The mask as the kernel takes it, made once in the graph (fused) rather than per chunk in the operator:
        # additive, and a key in every row of every chunk. A real query sees its own key, inside its chunk's
        # bound; a padding query (its output is discarded) or a row without any key is given every key.
        allowed = attn_mask | ~attn_mask.any(dim=-1, keepdim=True)
        if selection.valid is not None:
            allowed = allowed | ~selection.valid[:, None, :, None]
        attn_bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        chunk_ends = [end for _, end in chunks]
        out = torch.ops.torchtune_dtf.selected_attention_by_chunks(
            q, key, value, attn_bias, _operator_key_bounds(chunk_ends, last_key, key.shape[2]), chunk_ends,
            key_bounds, enable_gqa,
        )
    else:
        dropout_p = attn.attn_dropout if attn.training else 0.0
        out = _attention_by_chunks(q, key, value, attn_mask, is_causal, chunks, key_bounds, dropout_p, enable_gqa)
    out = out.transpose(1, 2).reshape(xs.shape[0], xs.shape[1], -1)
    attn_update = layer.sa_scale(attn.output_proj(out))
    h = xs + attn_update
    update = attn_update + layer.mlp_scale(layer.mlp(layer.mlp_norm(h)))
    if gate is not None:
        update = update * gather_tokens(gate, selection.positions)[..., None].to(update.dtype)
    return scatter_updates(x, selection, update)
