"""torchtune_dtf.modules.{selective_kv_cache, decoder}: prefill + decode equals a full student forward; only executed
tokens write K/V; the decoder keeps torchtune's cache API."""

import math

import pytest
import torch
from torchtune.generation import generate
from torchtune.modules.common_utils import disable_kv_cache, local_kv_cache

from tests.conftest import ROUTED_VARIANTS, VOCAB, build_tiny
from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext, SelectiveKVCache

MAX_LEN = 40


def causal_masks(batch, seq_len, max_len=MAX_LEN):
    return torch.tril(torch.ones(seq_len, max_len, dtype=torch.bool)).expand(batch, -1, -1)


def decode_incrementally(model, tokens, prompt_len):
    """Logits of every position, computed by a prompt prefill and then one token at a time."""
    batch, total = tokens.shape
    masks = causal_masks(batch, total)
    ctx = RoutingContext(mode="student")
    logits = [model(tokens[:, :prompt_len], mask=masks[:, :prompt_len], input_pos=torch.arange(prompt_len), routing=ctx)]
    executed = {i: r.selected_mask.clone() for i, r in ctx.layers.items()}
    for t in range(prompt_len, total):
        ctx = RoutingContext(mode="student")
        logits.append(model(tokens[:, t : t + 1], mask=masks[:, t : t + 1], input_pos=torch.full((batch,), t), routing=ctx))
        for i, r in ctx.layers.items():
            executed[i] = torch.cat([executed[i], r.selected_mask], dim=1)
    return torch.cat(logits, dim=1), executed


def check_decode_matches_full_forward(model, tokens, prompt_len=9):
    """Full student forward vs prompt prefill + token-by-token decode with caches; returns the
    per-layer executed masks of the decode and the routed layers."""
    full_ctx = RoutingContext(mode="student")
    full = model(tokens, routing=full_ctx)
    model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    routed = [layer for layer in model.layers if isinstance(layer, RoutedSelfAttentionLayer)]
    initial = {layer.layer_idx: layer.attn.kv_cache.allocated_entries for layer in routed}
    incremental, executed = decode_incrementally(model, tokens, prompt_len)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)
    for layer in routed:
        cache = layer.attn.kv_cache
        ran = executed[layer.layer_idx]
        assert torch.equal(ran, full_ctx.layers[layer.layer_idx].selected_mask)
        # Each row holds exactly the tokens that ran the block, at their layout slots.
        assert cache.fill.tolist() == ran.sum(-1).tolist()
        for row in range(tokens.shape[0]):
            n = int(cache.fill[row])
            assert cache.entry_slots[row, :n].tolist() == torch.nonzero(ran[row]).squeeze(-1).tolist()
    return executed, routed, initial


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_prefill_then_decode_matches_full_forward(variant, tokens):
    model = build_tiny(variant, student_threshold=0.5)
    executed, routed, _ = check_decode_matches_full_forward(model, tokens)
    for layer in routed:
        assert isinstance(layer.attn.kv_cache, SelectiveKVCache)
        ran = executed[layer.layer_idx]
        assert 0 < ran.sum() < ran.numel(), "a routed layer that runs every token (or none) proves nothing"


WINDOW_TOPK = dict(student_routing_mode="window_topk", student_threshold=None, student_window=5)


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_window_topk_decode_matches_full_forward(variant, tokens):
    # The window (5 tokens) is shorter than the prompt (9): decoding must carry the last 4 scores per row.
    model = build_tiny(variant, **WINDOW_TOPK)
    executed, routed, _ = check_decode_matches_full_forward(model, tokens)
    for layer in routed:
        ran = executed[layer.layer_idx]
        assert 0 < ran.sum() < ran.numel()
        assert layer.attn.kv_cache.recent_scores.shape == (tokens.shape[0], 4)


def test_window_topk_left_padded_batch_generates_like_each_row_alone():
    # Left pads start sequences of their own: a row's window never holds its pads' scores.
    model = build_tiny("stt", **WINDOW_TOPK)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (7, 4, 10)]
    width = max(len(p) for p in prompts)
    batch = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    with local_kv_cache(model, batch_size=3, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=width + 12):
        together, _ = generate(model, batch, max_generated_tokens=12, pad_id=0, temperature=1.0, top_k=1)
    for row, prompt in enumerate(prompts):
        with local_kv_cache(model, batch_size=1, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=len(prompt) + 12):
            alone, _ = generate(model, prompt[None], max_generated_tokens=12, pad_id=0, temperature=1.0, top_k=1)
        assert together[row, width:].tolist() == alone[0, len(prompt):].tolist()


def test_skipped_tokens_write_no_kv(tokens):
    model = build_tiny("stt", student_threshold=0.5)
    model.setup_caches(batch_size=3, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    ctx = RoutingContext(mode="student")
    model(tokens, mask=causal_masks(3, tokens.shape[1]), input_pos=torch.arange(tokens.shape[1]), routing=ctx)
    layer = model.layers[1]
    cache = layer.attn.kv_cache
    ran = ctx.layers[1].selected_mask
    for row in range(3):
        n = int(cache.fill[row])
        assert n == int(ran[row].sum())
        assert cache.k_cache[row, :, n:cache.allocated_entries].abs().sum() == 0  # nothing past the fill level
    # A standard layer's cache holds every token.
    assert model.layers[0].attn.kv_cache.size == tokens.shape[1]


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_cache_is_allocated_by_capacity_and_grows_without_losing_entries(variant, tokens):
    # A low threshold makes the student run most tokens, more than the γ·max_seq_len allocated up front.
    model = build_tiny(variant, student_threshold=0.2)
    _, routed, initial = check_decode_matches_full_forward(model, tokens)
    grown = 0
    for layer in routed:
        cache = layer.attn.kv_cache
        assert initial[layer.layer_idx] == math.ceil(layer.capacity * MAX_LEN) < MAX_LEN
        assert cache.allocated_entries >= int(cache.fill.max())
        assert cache.k_cache.shape[2] == cache.allocated_entries + 1  # + the scratch slot
        grown += cache.allocated_entries > initial[layer.layer_idx]
    assert grown, "no cache outgrew its initial allocation; the growth path went untested"


@pytest.mark.parametrize("student", ["topk", "threshold"])
def test_eager_prefill_allocates_what_runs_not_the_whole_prompt(student):
    # A 30-token prompt at γ = 0.5 stores about 15 entries per routed layer: they fit the ⌈γ·max_seq_len⌉ = 20
    # allocated up front, so the cache must not grow to the prompt's 30 (which would be a dense layer's memory).
    overrides = dict(student_routing_mode="topk", student_threshold=None, allow_noncausal_student_topk=True) \
        if student == "topk" else dict(student_threshold=0.5)
    model = build_tiny("mod", **overrides)
    batch, prompt_len = 2, 30
    tokens = torch.randint(0, VOCAB, (batch, prompt_len), generator=torch.Generator().manual_seed(5))
    model.setup_caches(batch_size=batch, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    routed = [layer for layer in model.layers if isinstance(layer, RoutedSelfAttentionLayer)]
    initial = {layer.layer_idx: layer.attn.kv_cache.allocated_entries for layer in routed}
    ctx = RoutingContext(mode="student")
    with torch.no_grad():
        model(tokens, mask=causal_masks(batch, prompt_len), input_pos=torch.arange(prompt_len), routing=ctx)
    for layer in routed:
        cache, ran = layer.attn.kv_cache, ctx.layers[layer.layer_idx].selected_mask
        assert 0 < int(ran.sum(-1).max()) <= initial[layer.layer_idx] < prompt_len, "the case proves nothing"
        assert cache.fill.tolist() == ran.sum(-1).tolist()
        assert cache.allocated_entries == initial[layer.layer_idx], "the prefill reserved room for tokens that skipped"


def test_cache_growth_keeps_entries_and_stops_at_max_seq_len():
    cache = SelectiveKVCache(batch_size=2, num_kv_heads=1, head_dim=2, max_seq_len=10, embed_dim=4,
                             dtype=torch.float32, initial_entries=2)
    rows = torch.arange(2)
    written = []
    for step in range(5):  # two entries per row per step: 2 → 4 → 6 → 8 → 10 allocated
        k = torch.randn(2, 1, 2, 2)
        cache.append(rows, k, -k, torch.tensor([[2 * step, 2 * step + 1]] * 2), torch.ones(2, 2, dtype=torch.bool))
        written.append(k)
    assert cache.allocated_entries == 10 and cache.fill.tolist() == [10, 10]
    keys, values, slots, valid = cache.entries(rows)
    torch.testing.assert_close(keys, torch.cat(written, dim=2))
    torch.testing.assert_close(values, -torch.cat(written, dim=2))
    assert slots[0].tolist() == list(range(10)) and bool(valid.all())
    with pytest.raises(RuntimeError, match="more than max_seq_len=10"):
        cache.append(rows[:1], torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2), torch.tensor([[10]]),
                     torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="initial_entries"):
        SelectiveKVCache(batch_size=1, num_kv_heads=1, head_dim=2, max_seq_len=4, embed_dim=4,
                         dtype=torch.float32, initial_entries=5)


def test_left_padded_batch_generates_like_each_row_alone():
    model = build_tiny("stt", student_threshold=0.5)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (7, 4, 10)]
    pad_id = 0
    width = max(len(p) for p in prompts)
    batch = torch.stack([torch.cat([torch.full((width - len(p),), pad_id), p]) for p in prompts])
    with local_kv_cache(model, batch_size=3, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=width + 8):
        together, _ = generate(model, batch, max_generated_tokens=8, pad_id=pad_id, temperature=1.0, top_k=1)
    for row, prompt in enumerate(prompts):
        with local_kv_cache(model, batch_size=1, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=len(prompt) + 8):
            alone, _ = generate(model, prompt[None], max_generated_tokens=8, pad_id=pad_id, temperature=1.0, top_k=1)
        assert together[row, width:].tolist() == alone[0, len(prompt):].tolist()


def test_decode_topk_has_a_hard_per_step_budget():
    model = build_tiny("mod", student_routing_mode="topk", student_threshold=None)
    batch = 4
    prompt = torch.randint(0, VOCAB, (batch, 8), generator=torch.Generator().manual_seed(2))
    masks = causal_masks(batch, 12)
    model.setup_caches(batch_size=batch, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    ctx = RoutingContext(mode="student")
    model(prompt, mask=masks[:, :8], input_pos=torch.arange(8), routing=ctx)
    assert ctx.layers[1].selected_mask.sum(-1).tolist() == [4] * batch  # per-sequence top-k of the prompt
    for t in range(8, 12):
        ctx = RoutingContext(mode="student")
        model(prompt[:, :1], mask=masks[:, t : t + 1], input_pos=torch.full((batch,), t), routing=ctx)
        # floor(0.5 · 4) = 2 of the 4 rows run each routed layer at each step.
        assert ctx.layers[1].selected_mask.sum().item() == 2
    assert int(model.layers[1].attn.kv_cache.fill.sum()) == 4 * batch + 2 * 4
    assert model.layers[0].attn.kv_cache.size == 12


def test_decode_topk_with_no_row_to_run_is_an_error():
    # floor(γ · 1) = 0: a batch-1 decode would skip every routed layer for every token, silently.
    model = build_tiny("mod", student_routing_mode="topk", student_threshold=None)
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    masks = causal_masks(1, 9)
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    model(prompt, mask=masks[:, :8], input_pos=torch.arange(8))
    with pytest.raises(ValueError, match=r"floor\(0.5 \* 1\) = 0 rows.*student_routing_mode='threshold'.*at least 2 rows"):
        model(prompt[:, :1], mask=masks[:, 8:9], input_pos=torch.tensor([8]))


def test_student_topk_on_a_whole_sequence_without_cache_is_refused(tokens):
    # A per-sequence top-k decides a token's fate from later tokens: not causal, so not an evaluation mode.
    model = build_tiny("stt", student_routing_mode="topk", student_threshold=None)
    with pytest.raises(ValueError, match="not causal.*allow_noncausal_student_topk"):
        model(tokens)
    analysis = build_tiny("stt", student_routing_mode="topk", student_threshold=None, allow_noncausal_student_topk=True)
    ctx = RoutingContext(mode="student")
    analysis(tokens, routing=ctx)
    assert ctx.layers[1].selected_mask.sum(-1).tolist() == [12, 12, 12]


def test_torchtune_cache_api_sets_up_resets_disables_and_keeps_logits(tokens):
    model = build_tiny("sdt")
    assert not model.caches_are_setup()
    model.setup_caches(batch_size=3, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    assert model.caches_are_setup() and model.caches_are_enabled()
    assert model.decoder_max_cache_seq_len == MAX_LEN
    model(tokens[:, :5], mask=causal_masks(3, 5), input_pos=torch.arange(5))
    assert model.layers[1].attn.kv_cache.size == 5
    model.reset_caches()
    assert model.layers[1].attn.kv_cache.size == 0 and model.layers[1].attn.kv_cache.fill.sum() == 0
    with disable_kv_cache(model):
        assert not model.caches_are_enabled()
        # torchtune's attention is only causal without a mask when no cache is set up, so pass one.
        seq_len = tokens.shape[1]
        no_cache = model(tokens, mask=causal_masks(3, seq_len, seq_len))  # caches untouched
    assert model.layers[1].attn.kv_cache.size == 0
    assert model.caches_are_enabled()
    model.reset_caches()
    # Student routing is causal and per row, so the cached prefill gives the same logits.
    cached = model(tokens, mask=causal_masks(3, tokens.shape[1]), input_pos=torch.arange(tokens.shape[1]))
    torch.testing.assert_close(cached, no_cache, rtol=1e-4, atol=1e-4)


def test_local_kv_cache_restores_cacheless_model(tokens):
    model = build_tiny("stt")
    expected = model(tokens)
    with local_kv_cache(model, batch_size=3, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=MAX_LEN):
        assert model.caches_are_enabled()
    assert not model.caches_are_setup()
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)


def test_chunked_output_concatenates_to_the_full_logits(tokens):
    model = build_tiny("mod")
    full = model(tokens)
    model.set_num_output_chunks(4)
    chunks = model(tokens)
    assert isinstance(chunks, list) and len(chunks) == 4
    torch.testing.assert_close(torch.cat(chunks, dim=1).float(), full)


def test_teacher_mode_refuses_caches(tokens):
    model = build_tiny("stt")
    model.setup_caches(batch_size=3, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    with pytest.raises(RuntimeError, match="Teacher routing is for training"):
        model(tokens, mask=causal_masks(3, tokens.shape[1]), input_pos=torch.arange(tokens.shape[1]),
              routing=RoutingContext(mode="teacher", beta_ce=1.0, beta_cu=1.0))


def record_routed_calls(model):
    """Hooks on every routed layer: the batch dimension of each mask it receives and, per layer,
    the student's decision of each call (``RoutingContext`` record). Returns (mask_batches, decisions, handles)."""
    mask_batches, decisions, handles = [], {}, []
    for layer in model.layers:
        if isinstance(layer, RoutedSelfAttentionLayer):
            handles.append(layer.register_forward_pre_hook(
                lambda mod, args, kwargs: mask_batches.append(kwargs["mask"].shape[0]), with_kwargs=True))
            handles.append(layer.register_forward_hook(
                lambda mod, args, kwargs, out: decisions.setdefault(mod.layer_idx, []).append(
                    kwargs["routing"].record_of(mod.layer_idx).selected_mask.clone()),
                with_kwargs=True))
    return mask_batches, decisions, handles


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_unpadded_batch_with_batch_one_mask_generates_like_each_row_alone(variant):
    # Equal-length prompts without a pad token: generate() builds one causal mask [1, L, max_len] for
    # the whole batch (no padding mask), and the routed layers must broadcast it over the rows.
    model = build_tiny(variant, student_threshold=0.5)
    pad_id, prompt_len, new = 0, 9, 8
    prompts = torch.randint(1, VOCAB, (3, prompt_len), generator=torch.Generator().manual_seed(11))
    assert (prompts != pad_id).all()
    mask_batches, together_ran, handles = record_routed_calls(model)
    with local_kv_cache(model, batch_size=3, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=prompt_len + new):
        together, _ = generate(model, prompts, max_generated_tokens=new, pad_id=pad_id, temperature=1.0, top_k=1)
    for handle in handles:
        handle.remove()
    assert mask_batches and set(mask_batches) == {1}, "the routed layers never saw a batch-1 mask"
    assert together.shape == (3, prompt_len + new)
    for idx, calls in together_ran.items():
        ran = torch.cat(calls, dim=1)  # prefill, then one column per decoded token
        assert ran.shape == (3, prompt_len + new - 1)
        assert 0 < ran.sum() < ran.numel(), f"routed layer {idx} ran every token (or none): proves nothing"
    for row in range(3):
        _, alone_ran, handles = record_routed_calls(model)
        with local_kv_cache(model, batch_size=1, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=prompt_len + new):
            alone, _ = generate(model, prompts[row : row + 1], max_generated_tokens=new, pad_id=pad_id, temperature=1.0, top_k=1)
        for handle in handles:
            handle.remove()
        assert together[row].tolist() == alone[0].tolist()
        for idx, calls in alone_ran.items():  # the same tokens ran the routed blocks as in the batch
            assert torch.equal(torch.cat(calls, dim=1)[0], torch.cat(together_ran[idx], dim=1)[row])


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_batch_one_mask_broadcasts_without_cache(variant, tokens):
    model = build_tiny(variant, student_threshold=0.5)
    batch, seq_len = tokens.shape
    mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))[None]  # [1, s, s]
    mask_batches, decisions, handles = record_routed_calls(model)
    broadcast = model(tokens, mask=mask)
    for handle in handles:
        handle.remove()
    assert mask_batches and set(mask_batches) == {1}
    for idx, (ran,) in decisions.items():
        assert ran.shape == (batch, seq_len) and 0 < ran.sum() < ran.numel(), f"routed layer {idx} ran all or none"
    assert torch.equal(broadcast, model(tokens, mask=mask.expand(batch, -1, -1)))
    torch.testing.assert_close(broadcast, model(tokens), rtol=0, atol=0)


def test_dropped_layers_allocate_no_kv_cache_and_decode_like_the_full_forward(tokens):
    model = build_tiny("layerdrop")  # layers 1 and 2 dropped
    full = model(tokens)
    model.setup_caches(batch_size=3, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    for idx in (1, 2):
        assert model.layers[idx].attn.kv_cache.k_cache.shape[2] == 1  # a placeholder entry, never written
    assert model.layers[0].attn.kv_cache.k_cache.shape[2] == MAX_LEN
    incremental, _ = decode_incrementally(model, tokens, prompt_len=9)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(full, build_tiny("dense")(tokens), atol=1e-3)  # the dropped layers really are skipped
    model.reset_caches()
    with disable_kv_cache(model):
        torch.testing.assert_close(model(tokens, mask=causal_masks(3, tokens.shape[1], tokens.shape[1])), full)


@pytest.mark.slow
def test_compiled_every_row_write_stores_in_place():
    # A decode step writes one entry per row. Compiled by inductor, a scatter_ into the buffer was not done in place:
    # the generated code copied the whole K/V buffer, scattered into the copy and copied it back, several times the
    # cache's bytes per layer and step. The write must store the entry and leave every loop over the buffer out.
    from torch._inductor.utils import run_and_get_code

    batch, heads, entries, head_dim = 1, 2, 4096, 16
    cache = SelectiveKVCache(batch_size=batch, num_kv_heads=heads, head_dim=head_dim, max_seq_len=entries,
                             embed_dim=32, dtype=torch.float32, static=True)
    cache.fill.fill_(7)
    key, value = torch.randn(batch, heads, 1, head_dim), torch.randn(batch, heads, 1, head_dim)

    def step(key, value):
        return cache.append(None, key, value, cache.layout_slots(torch.zeros(batch, 1, dtype=torch.long)))

    torch._dynamo.reset()
    written, code = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True), key, value)
    torch._dynamo.reset()
    assert written.tolist() == [[7]] and cache.fill.tolist() == [8]
    torch.testing.assert_close(cache.k_cache[:, :, 7:8], key)
    torch.testing.assert_close(cache.v_cache[:, :, 7:8], value)
    buffer_size = heads * (entries + 1) * head_dim  # the scratch entry included
    assert not any(f"{buffer_size}L" in source for source in code), "the compiled write copies the whole K/V buffer"
