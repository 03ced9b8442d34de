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
its attention scores. With ``skipped_tokens_write_kv`` the k selected queries attend over all s keys through an
explicit mask, so the attention kernel computes the whole k × s score rectangle, about twice the causal half
the closed form counts (not yet a kernel that skips the masked blocks).

Shapes: with a top-k selection every shape here is static (k slots per row, or ⌊γ·b⌋ rows of a decode step) and
nothing is read back from the device, so ``torch.compile(fullgraph=True)`` captures the whole layer.
"""

from typing import Optional

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
        rows_of_queries = torch.gather(mask, 1, query_index[..., None].expand(-1, -1, mask.shape[-1]))
        allowed = torch.gather(rows_of_queries, 2, key_slots[:, None, :].expand(-1, query_index.shape[1], -1))
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :]
    # A padding query may have no key at all; give it every key so softmax stays finite (its output is
    # discarded on scatter).
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    return allowed[:, None]


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
    x_rows = x if rows is None else x[rows]
    positions = positions if rows is None else positions[rows]
    mask = mask if (rows is None or mask is None) else mask[rows]
    query_index = selection.positions
    valid = selection.valid

    xs = gather_tokens(x_rows, query_index)
    h = layer.sa_norm(xs)
    query_positions = gather_tokens(positions, query_index)
    q = _project_queries(layer, h, query_positions)
    key, value = _project_keys_values(layer, h, query_positions)

    attn_mask, is_causal = None, False
    if cache is not None:
        row_ids = torch.arange(x.shape[0], device=x.device) if rows is None else rows
        query_slots = cache.seen + query_index
        cache.append(row_ids, key, value, query_slots, valid)
        key, value, key_slots, key_valid = cache.entries(row_ids)
        attn_mask = _attention_mask(mask, query_index, query_slots, key_slots, key_valid)
    elif mask is None and valid is None:
        is_causal = True  # gathered in time order, so causality among them is the lower triangle
    else:
        attn_mask = _attention_mask(mask, query_index, query_index, query_index, valid)

    gate_rows = gate if (rows is None or gate is None) else gate[rows]
    out_rows = _attend_and_update(layer, x_rows, xs, q, key, value, selection, gate_rows, attn_mask, is_causal)
    if rows is None:
        return out_rows
    return x.index_copy(0, rows, out_rows)


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
        all_rows = torch.arange(batch, device=x.device)
        slots = cache.seen + slots
        cache.append(all_rows, key, value, slots)
    if selection.num_selected == 0:
        return x
    rows = selection.rows
    if rows is not None:  # decoding: queries, MLP and update of the rows that run only
        if rows.shape[0] == 0:
            return x
        x_rows, h_rows, positions = x[rows], h_all[rows], positions[rows]
        mask = None if mask is None else mask[rows]
        gate = None if gate is None else gate[rows]
    else:
        x_rows, h_rows = x, h_all
    if cache is not None:
        key, value, slots, key_valid = cache.entries(all_rows if rows is None else rows)
    query_index = selection.positions
    xs = gather_tokens(x_rows, query_index)
    q = _project_queries(layer, gather_tokens(h_rows, query_index), gather_tokens(positions, query_index))
    query_slots = query_index if cache is None else cache.seen + query_index
    attn_mask = _attention_mask(mask, query_index, query_slots, slots, key_valid)
    out_rows = _attend_and_update(layer, x_rows, xs, q, key, value, selection, gate, attn_mask, False)
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
) -> torch.Tensor:
    """Attention of the selected queries, the MLP, and the gated update added back into ``x [b, s, d]``."""
    attn = layer.attn
    out = F.scaled_dot_product_attention(
        q,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=attn.attn_dropout if attn.training else 0.0,
        is_causal=is_causal,
        enable_gqa=attn.num_heads != attn.num_kv_heads,
    )
    out = out.transpose(1, 2).reshape(xs.shape[0], xs.shape[1], -1)
    attn_update = layer.sa_scale(attn.output_proj(out))
    h = xs + attn_update
    update = attn_update + layer.mlp_scale(layer.mlp(layer.mlp_norm(h)))
    if gate is not None:
        update = update * gather_tokens(gate, selection.positions)[..., None].to(update.dtype)
    return scatter_updates(x, selection, update)
