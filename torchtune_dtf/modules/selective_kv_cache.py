"""Per-row KV cache for routed layers: only tokens that ran the block write K/V (docs/design.md §4).

torchtune's ``KVCache`` keeps one shared write position for the whole batch. A routed layer cannot:
each row executes a different number of tokens, so each row has its own fill level. Every stored entry
remembers its *slot*, the index of its token in the batch's shared sequence layout (the same index the
global attention mask from ``torchtune.generation`` uses along its last dimension). Masks for cached
attention are built by looking the stored slots up in that global mask (causality and left padding),
or by comparing slots when no mask is given.

The cache also carries, from one chunk to the next, what a layer needs about the tokens before the chunk:
the term each row's last token hands the two-token causal router of the next (W_p·RMSNorm(x_{t−1})), its last
routed output (the TPN's input with ``skip_update: predicted``) and its last router scores (a window top-k
student). The cache alone advances all of its state: :meth:`SelectiveKVCache.append` stores entries, and the
layer hands over what to carry with :meth:`~SelectiveKVCache.carry_router_term`,
:meth:`~SelectiveKVCache.carry_scores`, :meth:`~SelectiveKVCache.carry_output` and, at the end of each chunk,
:meth:`~SelectiveKVCache.advance`.

Two ways to hold the entries:

* growing (the default): memory follows what runs. The buffers start at ``initial_entries`` per row (the
  layer's capacity γ·max_seq_len, see ``RoutedSelfAttentionLayer.setup_caches``) and grow by a quarter, up
  to ``max_seq_len``, only when a row would overflow them. The cache keeps on the host an upper bound of the
  fullest row (raised by what the decoder announces before each forward, ``make_room``), so it reads the true fill levels back from the device
  only when that bound says the buffers might overflow, and attention reads entries up to the bound.
* ``static``: ``max_seq_len`` entries per row from the start (the gpt-fast pattern). No write or read ever
  looks at the fill levels on the host and no shape changes, so a compiled decode step is one graph that a
  GPU can replay; attention masks the entries past each row's fill. Memory is the dense layer's.
"""

import math
from typing import Optional, Tuple

import torch
from torch import nn


class SelectiveKVCache(nn.Module):
    """
    Args:
        batch_size (int): b.
        num_kv_heads (int): number of key/value heads.
        head_dim (int): dimension of each head.
        max_seq_len (int): the longest layout the cache can follow, hence the most entries a row can hold.
        embed_dim (int): model width, for the carried previous-token output.
        dtype (torch.dtype): dtype of keys, values and carried state.
        initial_entries (Optional[int]): entries per row allocated up front (default ``max_seq_len``);
            the buffers grow on demand up to ``max_seq_len``. Ignored when ``static``.
        static (bool): allocate ``max_seq_len`` entries per row and never grow or read fill levels back.
        score_history (int): router scores of the last tokens kept per row, for a student that ranks a token
            among its predecessors' scores (``window_topk``: w − 1); 0 keeps none.
        router_carry_dim (int): width of the causal router's carried term (``CausalRouter.carry_dim``: its
            hidden width when it reads the previous token); 0 keeps none.

    Buffers (``n`` = entries allocated per row, ``allocated_entries``):
        k_cache, v_cache: ``[b, n_kv, n + 1, h_d]``; the last entry is a scratch slot that absorbs the
            writes of padding entries of a ragged selection.
        entry_slots: ``[b, n + 1]`` layout slot of each stored entry.
        fill: ``[b]`` number of stored entries per row.
        seen: ``[]`` number of layout slots consumed so far (tokens seen per row, run or skipped): the slot
            of the current chunk's first token.
        router_carry: ``[b, router_carry_dim]`` the previous token's term for the causal router of the next
            token (``CausalRouter.forward(..., return_carried=True)``), per row.
        last_output: ``[b, d]`` the previous token's routed output before any skip-path forecast, per row
            (the TPN's input when ``skip_update: predicted``).
        recent_scores, recent_scores_valid: ``[b, score_history]`` fp32 router scores of the last tokens,
            oldest first, and which of them belong to the row's current sequence.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        embed_dim: int,
        dtype: torch.dtype,
        initial_entries: Optional[int] = None,
        static: bool = False,
        score_history: int = 0,
        router_carry_dim: int = 0,
    ) -> None:
        super().__init__()
        initial_entries = max_seq_len if (initial_entries is None or static) else initial_entries
        if not 0 < initial_entries <= max_seq_len:
            raise ValueError(f"initial_entries must be in [1, max_seq_len={max_seq_len}], got {initial_entries}")
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.static = static
        # Growing cache only, host-side (never read from the device): at least as many entries as the
        # fullest row holds, and the entries per row announced by make_room and not yet written.
        self._fill_bound = 0
        self._announced = 0
        shape = (batch_size, num_kv_heads, initial_entries + 1, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer(
            "entry_slots", torch.zeros(batch_size, initial_entries + 1, dtype=torch.long), persistent=False
        )
        self.register_buffer("fill", torch.zeros(batch_size, dtype=torch.long), persistent=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("router_carry", torch.zeros(batch_size, router_carry_dim, dtype=dtype), persistent=False)
        self.register_buffer("last_output", torch.zeros(batch_size, embed_dim, dtype=dtype), persistent=False)
        self.register_buffer("recent_scores", torch.zeros(batch_size, score_history), persistent=False)
        self.register_buffer(
            "recent_scores_valid", torch.zeros(batch_size, score_history, dtype=torch.bool), persistent=False
        )

    def reset(self) -> None:
        """Empty the cache without reallocating it."""
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.entry_slots.zero_()
        self.fill.zero_()
        self.seen.zero_()
        self.router_carry.zero_()
        self.last_output.zero_()
        self.recent_scores.zero_()
        self.recent_scores_valid.zero_()
        self._fill_bound = 0
        self._announced = 0

    def sync_fill_bound(self) -> None:
        """Re-read the host-side bound on the rows' fill after the buffers were written from outside the cache
        (e.g. a stored prompt copied into every row); one host read."""
        self._fill_bound = int(self.fill.max())

    @property
    def allocated_entries(self) -> int:
        """Entries per row the buffers can hold now (without the scratch slot)."""
        return self.k_cache.shape[2] - 1

    def reserve(self, entries: int) -> None:
        """Make room for at least ``entries`` per row, keeping what is stored.

        Grows to max(entries, 1.25 × the current allocation), capped at ``max_seq_len``: a student that
        runs a little more than its capacity overshoots by at most a quarter, and a long generation
        still reallocates only O(log) times.
        """
        if entries > self.max_seq_len:
            raise RuntimeError(
                f"SelectiveKVCache overflow: a row would hold {entries} entries, more than "
                f"max_seq_len={self.max_seq_len}"
            )
        current = self.allocated_entries
        if entries <= current:
            return
        new = min(self.max_seq_len, max(entries, current + math.ceil(current / 4)))
        for name, entry_dim in (("k_cache", 2), ("v_cache", 2), ("entry_slots", 1)):
            old = getattr(self, name)
            shape = list(old.shape)
            shape[entry_dim] = new + 1
            grown = old.new_zeros(shape)
            # Stored entries only: the old scratch slot (last index) holds padding writes by design.
            grown.narrow(entry_dim, 0, current).copy_(old.narrow(entry_dim, 0, current))
            setattr(self, name, grown)

    @property
    def size(self) -> int:
        """Layout slots consumed so far (mirrors ``KVCache.size``)."""
        return int(self.seen)

    def layout_slots(self, index: torch.Tensor) -> torch.Tensor:
        """Layout slots of the current chunk's tokens at ``index`` (indices into the chunk, any shape): the
        chunk starts at slot ``seen``. Same shape as ``index``; stays on the device (no host read)."""
        return self.seen + index

    def append(
        self,
        rows: Optional[torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        valid: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Store the K/V of the tokens that ran the block.

        Args:
            rows (Optional[torch.Tensor]): ``[r]`` ascending batch rows being written; None: every row (r = b),
                without indexing the per-row state by them.
            k (torch.Tensor): ``[r, n_kv, k, h_d]`` keys (RoPE applied) of the gathered tokens.
            v (torch.Tensor): ``[r, n_kv, k, h_d]`` values.
            slots (torch.Tensor): ``[r, k]`` layout slots of those tokens.
            valid (Optional[torch.Tensor]): ``[r, k]`` bool; False entries are padding and are not stored.
                None: every entry is stored.

        Returns:
            torch.Tensor: ``[r, k]`` the entry index each token was stored at along the entry axis of
            :meth:`entries` (the scratch index ``allocated_entries`` for padding). Entries are stored in time
            order, so this is also the last key a query among these tokens may attend to.
        """
        num_new = k.shape[2]
        if not (self.static or torch.compiler.is_compiling()):
            # Eager: take the room from what the decoder announced (make_room), or make room here for the
            # entries being written (the decoder defers to this for eager layers). Compiled code reads no
            # host-side state (it would become a guard): the decoder announced it.
            if num_new > self._announced:
                self.make_room(num_new)
            self._announced -= num_new
        fill = self.fill[:, None] if rows is None else self.fill[rows, None]
        if valid is None:
            # One token per row (a decode step) is stored at the row's fill (a copy: ``fill`` moves on below).
            write_at = fill.clone() if num_new == 1 else fill + torch.arange(num_new, device=slots.device)
            counts = num_new
        else:
            counts = valid.sum(dim=-1)
            offsets = fill + torch.cumsum(valid.long(), dim=-1) - 1
            write_at = torch.where(valid, offsets, torch.full_like(offsets, self.allocated_entries))
        if rows is None and valid is None and not torch.compiler.is_compiling():
            # Every row, every entry: a row's entries go to distinct indices, so one scatter along the entry axis
            # per buffer writes them (the same values as the indexed write below, in fewer operators). Eager only:
            # inductor (torch 2.13, CPU) does not write a scatter_ into the buffer in place but copies the whole
            # buffer, scatters into the copy and copies it back, several times the cache per layer and decode step;
            # the indexed write below it does in place.
            heads = write_at.view(k.shape[0], 1, num_new, 1).expand(-1, k.shape[1], -1, k.shape[3])
            dtype = self.k_cache.dtype  # no conversion operator for keys already in it (the usual case)
            self.k_cache.scatter_(2, heads, k if k.dtype == dtype else k.to(dtype))
            self.v_cache.scatter_(2, heads, v if v.dtype == dtype else v.to(dtype))
            self.entry_slots.scatter_(1, write_at, slots)
        else:
            row_ids = torch.arange(k.shape[0], device=write_at.device) if rows is None else rows
            row_index = row_ids[:, None].expand_as(write_at)
            # [r, k, n_kv, h_d] views so advanced indexing on (row, entry) writes whole heads at once.
            self.k_cache.permute(0, 2, 1, 3)[row_index, write_at] = k.permute(0, 2, 1, 3).to(self.k_cache.dtype)
            self.v_cache.permute(0, 2, 1, 3)[row_index, write_at] = v.permute(0, 2, 1, 3).to(self.v_cache.dtype)
            self.entry_slots[row_index, write_at] = slots
        if rows is None:
            self.fill.add_(counts)  # in place: ``+=`` would re-assign the buffer (a Module.__setattr__ per call)
        else:
            self.fill[rows] += counts
        return write_at

    # -- state carried to the next chunk: the layer hands it over, the cache writes it --------------
    def carry_router_term(self, term: Optional[torch.Tensor]) -> None:
        """Keep each row's ``term [b, router_carry_dim]``, what the chunk's last token hands the causal router of
        the next chunk's first token (None: the router reads no previous token, nothing to keep)."""
        if term is not None:
            self.router_carry.copy_(term.detach())

    def carry_scores(self, recent: torch.Tensor, recent_valid: torch.Tensor) -> None:
        """Keep the router scores a window top-k student ranks the next chunk's tokens among:
        ``recent [b, score_history]`` fp32, oldest first, and ``recent_valid [b, score_history]`` bool, which
        of them belong to the row's current sequence (:func:`~torchtune_dtf.modules.selection.window_topk_mask`
        returns both)."""
        self.recent_scores.copy_(recent)
        self.recent_scores_valid.copy_(recent_valid)

    def carry_output(self, out: torch.Tensor) -> None:
        """Keep each row's last routed output of ``out [b, s, d]`` (before any skip-path forecast): the TPN's
        input for the first token of the next chunk. Detached: a chunk never backpropagates into the next."""
        self.last_output.copy_(out[:, -1].detach())

    def advance(self, x: torch.Tensor) -> None:
        """End a chunk of layer inputs ``x [b, s, d]``: move ``seen`` on by the s layout slots it consumed.
        Called once per forward, after everything that reads ``seen``."""
        self.seen.add_(x.shape[1])

    def make_room(self, num_new: int, *, deferred: bool = False) -> None:
        """Announce that the next writes add at most ``num_new`` entries to any row, and make room for them.

        The decoder calls this for every routed layer before each forward (outside any compiled layer),
        so a compiled ``append`` never decides an allocation. A growing cache raises its host-side bound of
        the fullest row by ``num_new``; only when that bound exceeds the allocation does it read the true
        fill levels from the device (one host read) and grow. A static cache has room by construction.

        ``deferred`` (the layer runs eagerly): announce nothing; ``append`` makes room for the entries it
        really writes. A chunk of s tokens stores only those that run the block (⌊γ·s⌋ of a top-k row), so
        room for all s would allocate a prompt's K/V as a dense layer does.
        """
        if self.static:
            return
        if deferred:
            self._announced = 0
            return
        self._announced = num_new
        if self._fill_bound + num_new > self.allocated_entries:
            self._fill_bound = int(self.fill.max())  # the bound says a row might overflow: look
            self.reserve(self._fill_bound + num_new)
        self._fill_bound += num_new

    def entries(
        self, rows: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stored entries of ``rows`` (``[r]`` ascending, or None for every row): the first ``n`` of each row,
        ``n`` the host-side bound of the fill (a growing cache) or ``max_seq_len`` (a static one); ``valid`` marks
        those a row really holds.

        Returns:
            Tuple of keys ``[r, n_kv, n, h_d]``, values ``[r, n_kv, n, h_d]``, slots ``[r, n]`` and a
            validity mask ``[r, n]``.
        """
        length = self.allocated_entries
        if not (self.static or torch.compiler.is_compiling()):
            length = min(self._fill_bound, length)  # eager: no further than any row can have written
        if rows is None or rows.shape[0] == self.batch_size:
            # The full batch (ascending rows, so every row in order): views, no row copy.
            fill = self.fill
            k, v, slots = self.k_cache, self.v_cache, self.entry_slots
        else:
            fill = self.fill[rows]
            k, v, slots = self.k_cache[rows], self.v_cache[rows], self.entry_slots[rows]
        valid = torch.arange(length, device=fill.device)[None, :] < fill[:, None]
        return k[:, :, :length], v[:, :, :length], slots[:, :length], valid
