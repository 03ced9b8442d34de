"""torchtune_dtf.modules.{layers, routed_block}, torchtune_dtf.training.{routing_losses, schedules}, torchtune_dtf.recipes.routed_finetune:
the matched-compute baselines (static layer dropping, random routing) and the techniques that keep a converted model's
quality (context-preserving K/V, predicted skip update, capacity curriculum, dense distillation, the dense routing
mode), each checked against a reference computed independently."""

import math

import pytest
import torch
from torchtune.modules import TransformerSelfAttentionLayer

from tests.conftest import VOCAB, build_tiny, routing_kwargs, tiny_architecture
from tests.test_selective_cache import MAX_LEN, causal_masks, decode_incrementally
from torchtune_dtf.models.qwen2_5 import routed_qwen2
from torchtune_dtf.modules import DroppedLayer, RandomRoutedLayer, RoutedSelfAttentionLayer, RoutingContext
from torchtune_dtf.modules.routers import previous_token_states
from torchtune_dtf.training.routing_losses import distillation_loss
from torchtune_dtf.training.schedules import CapacityCurriculum, Distillation

SURPRISE_BETAS = dict(beta_ce=100.0, beta_cu=100.0)


def dense_block(layer, x):
    """The layer's block as torchtune's dense layer computes it (every token, causal)."""
    return TransformerSelfAttentionLayer.forward(layer, x)


def layer_inputs(model, tokens, upto):
    """Input of layer ``upto`` of ``model`` in student mode."""
    h = model.tok_embeddings(tokens)
    for layer in model.layers[:upto]:
        h = layer(h) if not isinstance(layer, RoutedSelfAttentionLayer) else layer(h, routing=RoutingContext(mode="student"))
    return h


# ---- dense routing mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mod", "sdt", "stt", "random"])
def test_dense_routing_mode_is_the_dense_model(variant, tokens):
    dense = build_tiny("dense")
    routed = build_tiny(variant)
    ctx = RoutingContext(mode="dense")
    torch.testing.assert_close(routed(tokens, routing=ctx), dense(tokens), rtol=0, atol=0)
    assert all(bool(r.selected_mask.all()) for r in ctx.layers.values())
    # and the student of the same model is not (the comparison can fail)
    assert not torch.allclose(routed(tokens), dense(tokens), atol=1e-3)


# ---- static layer dropping ---------------------------------------------------------------------------


def test_layerdrop_equals_the_dense_model_without_those_layers(tokens):
    dense = build_tiny("dense")
    dropped = build_tiny("layerdrop", dropped_layers=[1, 2])
    assert [type(layer) for layer in dropped.layers][1:3] == [DroppedLayer, DroppedLayer]
    # Same keys as the dense checkpoint: a stock checkpoint loads strictly.
    assert dropped.state_dict().keys() == dense.state_dict().keys()
    with torch.no_grad():
        h = dense.tok_embeddings(tokens)
        for i in (0, 3):
            h = dense.layers[i](h)
        expected = dense.output(dense.norm(h))
    torch.testing.assert_close(dropped(tokens), expected, rtol=1e-5, atol=1e-5)


def test_layerdrop_with_skip_bias_adds_each_dropped_layers_vector_to_every_token(tokens):
    dense = build_tiny("dense")
    dropped = build_tiny("layerdrop", dropped_layers=[1, 2], skip_update="bias")
    missing, unexpected = dropped.load_state_dict(dense.state_dict(), strict=False)
    assert sorted(missing) == ["layers.1.skip_bias.update", "layers.2.skip_bias.update"] and not unexpected
    torch.testing.assert_close(dropped(tokens), build_tiny("layerdrop", dropped_layers=[1, 2])(tokens), rtol=0, atol=0)
    dim = dropped.layers[1].skip_bias.update.numel()
    first, second = torch.linspace(-1, 1, dim), torch.linspace(0.5, -0.25, dim)
    with torch.no_grad():
        dropped.layers[1].skip_bias.update.copy_(first)
        dropped.layers[2].skip_bias.update.copy_(second)
        h = dense.tok_embeddings(tokens)
        h = dense.layers[0](h) + first + second
        expected = dense.output(dense.norm(dense.layers[3](h)))
    torch.testing.assert_close(dropped(tokens), expected, rtol=1e-5, atol=1e-5)


def test_layerdrop_refuses_a_forecast_it_does_not_have():
    with pytest.raises(ValueError, match="layerdrop's skip_update must be 'none', 'bias' or 'linear'"):
        routed_qwen2("layerdrop", **tiny_architecture(), dropped_layers=[1], skip_update="predicted")


@pytest.mark.parametrize("bad, message", [
    ([], "resolves to no layer"),
    ([0, 1, 2, 3], "drops every layer"),
    ([1, 9], r"dropped_layers \[9\] are outside"),
    ("every_third", "dropped_layers must be one of"),
])
def test_invalid_dropped_layers_are_rejected_naming_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        routed_qwen2("layerdrop", **tiny_architecture(), dropped_layers=bad, skip_update="none")


# ---- layer dropping inside a routed model --------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mod", "stt"])
def test_routed_model_drops_whole_layers_and_routes_the_others(variant, tokens):
    """``dropped_layers`` in a routed config: the dropped layer runs on no token in every mode, the routed
    layer still routes, and the checkpoint keys stay the dense model's."""
    dense = build_tiny("dense")
    hybrid = build_tiny(variant, routed_layers=[1], dropped_layers=[2])
    assert [type(layer).__name__ for layer in hybrid.layers][1:3] == [type(build_tiny(variant).layers[1]).__name__,
                                                                      "DroppedLayer"]
    backbone = {k for k in hybrid.state_dict() if "router" not in k and "transition" not in k}
    assert backbone == set(dense.state_dict())
    with torch.no_grad():
        # dense mode: the routed layer runs every token, the dropped one none — layer dropping of layer 2
        layerdrop = build_tiny("layerdrop", dropped_layers=[2])
        torch.testing.assert_close(hybrid(tokens, routing=RoutingContext(mode="dense")), layerdrop(tokens),
                                   rtol=1e-5, atol=1e-5)
        # student mode: layer 1 routes (some tokens skip it), layer 2 is the identity
        ctx = RoutingContext(mode="student")
        h = hybrid.layers[1](hybrid.layers[0](hybrid.tok_embeddings(tokens)), routing=ctx)
        expected = hybrid.output(hybrid.norm(hybrid.layers[3](h)))
        student_ctx = RoutingContext(mode="student")
        torch.testing.assert_close(hybrid(tokens, routing=student_ctx), expected, rtol=1e-5, atol=1e-5)
    assert sorted(student_ctx.layers) == [1]
    executed = student_ctx.layers[1].selected_mask
    assert 0 < executed.sum() < executed.numel()


@pytest.mark.parametrize("write_kv", [False, True])
def test_cached_decoding_of_a_routed_model_with_dropped_layers_matches_its_full_forward(write_kv, tokens):
    model = build_tiny("stt", routed_layers=[1], dropped_layers=[2], skipped_tokens_write_kv=write_kv,
                       skip_update="predicted" if write_kv else "none").eval()
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
        incremental, executed = decode_incrementally(model, tokens, prompt_len=9)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)
    assert sorted(executed) == [1] and 0 < executed[1].sum() < executed[1].numel()


@pytest.mark.parametrize("variant, routing, message", [
    ("stt", dict(routed_layers=[1, 3], dropped_layers=[3]), r"layers \[3\] are both routed and dropped"),
    ("sdt", dict(routed_layers=[3], dropped_layers=[2]), r"SDT Decision layer\(s\) \[2\] .* cannot be dropped"),
    ("mod", dict(routed_layers=[1], dropped_layers=[7]), r"dropped_layers \[7\] are outside"),
])
def test_invalid_dropped_layers_of_a_routed_model_are_rejected(variant, routing, message):
    with pytest.raises(ValueError, match=message):
        routed_qwen2(variant, **tiny_architecture(), **routing_kwargs(variant, **routing))


def test_a_routed_config_without_dropped_layers_is_rejected():
    routing = routing_kwargs("stt")
    del routing["dropped_layers"]
    with pytest.raises(ValueError, match="missing required routing hyperparameter.*dropped_layers"):
        routed_qwen2("stt", **tiny_architecture(), **routing)


# ---- random routing ----------------------------------------------------------------------------------


def test_random_routing_keeps_its_budget_redraws_per_forward_and_is_seeded():
    torch.manual_seed(0)
    model = build_tiny("random", capacity=0.5)
    assert not any(p.numel() for n, p in model.named_parameters() if "router" in n)
    tokens = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(1))
    teacher_masks = []
    for _ in range(2):
        ctx = RoutingContext(mode="teacher", **SURPRISE_BETAS)
        model(tokens, routing=ctx)
        masks = {i: r.selected_mask for i, r in ctx.layers.items()}
        assert sorted(masks) == [1, 3]
        for mask in masks.values():
            assert mask.sum(-1).tolist() == [32] * 8  # exactly ⌊γ·n⌋ per sequence
            first_half = mask[:, :32].sum() / mask.sum()
            assert 0.35 < first_half < 0.65, "random selection must not be position order"
        teacher_masks.append(masks[1])
    assert not torch.equal(teacher_masks[0], teacher_masks[1]), "a fresh draw every forward"
    ctx = RoutingContext(mode="student")
    model(torch.randint(0, VOCAB, (16, 256), generator=torch.Generator().manual_seed(2)), routing=ctx)
    for record in ctx.layers.values():
        assert abs(record.selected_fraction.item() - 0.5) < 0.02  # causal Bernoulli(γ): γ in expectation
    # seeded → reproducible
    torch.manual_seed(5)
    a = model(tokens)
    torch.manual_seed(5)
    torch.testing.assert_close(model(tokens), a, rtol=0, atol=0)


def test_random_routing_is_causal(tokens):
    model = build_tiny("random")
    torch.manual_seed(3)
    full = model(tokens)
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % VOCAB
    torch.manual_seed(3)
    torch.testing.assert_close(model(changed)[:, :12], full[:, :12], rtol=0, atol=0)


def test_random_routing_takes_a_routed_recipes_shape_dropped_layers_and_skip_bias(tokens):
    """Attribution baseline (d): random selection on the routed layers of a hybrid (a dropped layer beside it), its
    skipped tokens given the learned constant update as a routed recipe's are."""
    model = build_tiny("random", routed_layers=[1], dropped_layers=[2], skip_update="bias", skipped_tokens_write_kv=True)
    routed, dropped = model.layers[1], model.layers[2]
    assert isinstance(routed, RandomRoutedLayer) and isinstance(dropped, DroppedLayer) and dropped.skip_bias is not None
    with torch.no_grad():
        routed.skip_bias.update.copy_(torch.linspace(-1, 1, routed.skip_bias.update.numel()))
    x = layer_inputs(model, tokens, 1)
    ctx = RoutingContext(mode="student")
    torch.manual_seed(0)
    out = routed(x, routing=ctx)
    ran = ctx.layers[1].selected_mask
    assert 0 < ran.sum() < ran.numel()
    expected = torch.where(ran[..., None], dense_block(routed, x), x + routed.skip_bias())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="skip_update: predicted needs a forecast.*variant 'random'"):
        build_tiny("random", skip_update="predicted")


# ---- context-preserving routed attention (skipped tokens write K/V) ----------------------------------


@pytest.mark.parametrize("variant", ["mod", "stt", "random"])
def test_write_kv_selected_tokens_get_the_dense_update(variant, tokens):
    """With every token a key/value, a selected token's attention is the dense layer's, so its update is
    exactly the dense block's; skipped tokens pass unchanged."""
    model = build_tiny(variant, skipped_tokens_write_kv=True, gate="straight_through") if variant != "random" else \
        build_tiny(variant, skipped_tokens_write_kv=True)
    layer = model.layers[1]
    x = layer_inputs(model, tokens, 1)
    ctx = RoutingContext(mode="student")
    torch.manual_seed(0)
    out = layer(x, routing=ctx)
    ran = ctx.layers[1].selected_mask
    assert 0 < ran.sum() < ran.numel()
    expected = torch.where(ran[..., None], dense_block(layer, x), x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Without the option the selected tokens see only each other: the update differs.
    layer.skipped_tokens_write_kv = False
    torch.manual_seed(0)
    assert not torch.allclose(layer(x, routing=RoutingContext(mode="student")), expected, atol=1e-4)


@pytest.mark.parametrize("variant", ["mod", "stt"])
def test_write_kv_cache_holds_every_token_and_decode_matches(variant, tokens):
    model = build_tiny(variant, skipped_tokens_write_kv=True, student_threshold=0.5)
    full_ctx = RoutingContext(mode="student")
    full = model(tokens, routing=full_ctx)
    model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    incremental, executed = decode_incrementally(model, tokens, prompt_len=9)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)
    for layer in model.layers:
        if isinstance(layer, RoutedSelfAttentionLayer):
            ran = executed[layer.layer_idx]
            assert torch.equal(ran, full_ctx.layers[layer.layer_idx].selected_mask)
            assert 0 < ran.sum() < ran.numel()
            cache = layer.attn.kv_cache
            assert cache.fill.tolist() == [tokens.shape[1]] * tokens.shape[0]  # every token wrote K/V
            assert cache.entry_slots[0, : tokens.shape[1]].tolist() == list(range(tokens.shape[1]))


def test_write_kv_packed_documents_stay_apart():
    """Block-causal mask: a selected token never attends to another document's (skipped) tokens."""
    model = build_tiny("mod", skipped_tokens_write_kv=True)
    a = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    b = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(5))
    packed = torch.cat([a, b], dim=1)
    mask = torch.zeros(1, 24, 24, dtype=torch.bool)
    mask[0, :10, :10] = torch.tril(torch.ones(10, 10, dtype=torch.bool))
    mask[0, 10:, 10:] = torch.tril(torch.ones(14, 14, dtype=torch.bool))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    torch.testing.assert_close(model(packed, mask=mask, input_pos=positions)[:, 10:], model(b), rtol=1e-5, atol=1e-5)


# ---- attention that computes only the scores it keeps ------------------------------------------------


def packed_inputs(tokens):
    """Each row of ``tokens [b, s]`` as two documents (first 20 tokens, the rest): block-causal mask and positions."""
    batch, seq_len = tokens.shape
    split = 20
    mask = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    mask[:split, :split] = torch.tril(torch.ones(split, split, dtype=torch.bool))
    mask[split:, split:] = torch.tril(torch.ones(seq_len - split, seq_len - split, dtype=torch.bool))
    positions = torch.cat([torch.arange(split), torch.arange(seq_len - split)])
    return dict(mask=mask.expand(batch, -1, -1), input_pos=positions.expand(batch, -1))


def record_key_bounds(monkeypatch):
    """Every (per-chunk key counts, keys available) the routed attention decides, in call order."""
    from torchtune_dtf.modules import routed_block

    calls, decide = [], routed_block.chunk_key_bounds

    def recording(chunks, last_key, valid, num_keys, static_bounds):
        bounds = decide(chunks, last_key, valid, num_keys, static_bounds)
        calls.append((bounds, num_keys))
        return bounds

    monkeypatch.setattr(routed_block, "chunk_key_bounds", recording)
    return calls


STUDENTS = {
    "threshold": {},
    "topk": dict(student_routing_mode="topk", student_threshold=None, allow_noncausal_student_topk=True),
}


@pytest.mark.parametrize("variant", ["mod", "stt"])
@pytest.mark.parametrize("write_kv", [False, True])
@pytest.mark.parametrize("student", ["threshold", "topk"])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_attention_equals_one_call_over_every_key(variant, write_kv, student, packed, small_query_chunks, monkeypatch):
    """Queries attend chunk by chunk over a prefix of the keys; the logits are those of one attention call over
    all keys through the mask, and the chunks really stop short of the last key (the work they skip)."""
    from torchtune_dtf.modules import routed_block

    tokens = torch.randint(0, VOCAB, (3, 64), generator=torch.Generator().manual_seed(11))
    inputs = packed_inputs(tokens) if packed else {}
    model = build_tiny(variant, skipped_tokens_write_kv=write_kv, **STUDENTS[student])
    bounds = record_key_bounds(monkeypatch)
    ctx = RoutingContext(mode="student")
    chunked = model(tokens, routing=ctx, **inputs)
    for layer in model.layers:
        if isinstance(layer, RoutedSelfAttentionLayer):
            ran = ctx.layers[layer.layer_idx].selected_mask.sum(-1)
            assert (ran > 16).all() and (ran < 64).all(), ran  # several chunks, and skipped tokens
    if write_kv:  # the bounds follow the selection: a real prefix of the 64 keys, not the rectangle
        assert bounds and all(len(b) > 1 and min(b) < n for b, n in bounds), bounds
    monkeypatch.setattr(routed_block, "_MAX_QUERY_CHUNKS", 1)
    torch.testing.assert_close(chunked, model(tokens, **inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("write_kv", [False, True])
def test_chunked_attention_over_the_selective_cache_decodes_as_the_full_forward(write_kv, small_query_chunks, monkeypatch):
    """A 32-token prefill attends chunk by chunk over the cache's entries (bounded by each query's own entry);
    decoding on from it gives the full forward's logits."""
    tokens = torch.randint(0, VOCAB, (3, MAX_LEN), generator=torch.Generator().manual_seed(12))
    model = build_tiny("stt", skipped_tokens_write_kv=write_kv, student_threshold=0.3)
    full = model(tokens)
    model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    bounds = record_key_bounds(monkeypatch)
    incremental, _ = decode_incrementally(model, tokens, prompt_len=32)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)
    prefill = [(b, n) for b, n in bounds if len(b) > 1]
    assert prefill and all(min(b) < n for b, n in prefill), bounds


# ---- predicted update on the skip path (STT) ---------------------------------------------------------


def test_predicted_skip_update_is_the_tpn_forecast_from_the_previous_output(tokens):
    plain = build_tiny("stt")
    predicted = build_tiny("stt", skip_update="predicted")
    predicted.load_state_dict(plain.state_dict())
    layer = predicted.layers[1]
    with torch.no_grad():  # a TPN that is not ~0 at init, so the forecast is visible
        layer.transition.down_proj.weight.mul_(50)
        plain.layers[1].transition.down_proj.weight.mul_(50)
    x = layer_inputs(plain, tokens, 1)
    ctx = RoutingContext(mode="student")
    base = plain.layers[1](x, routing=ctx)
    ran = ctx.layers[1].selected_mask
    assert 0 < ran.sum() < ran.numel()
    starts = torch.zeros_like(ran)
    starts[:, 0] = True
    forecast = layer.transition(previous_token_states(base, starts))
    expected = base + forecast * (~ran)[..., None]
    out = layer(x, routing=RoutingContext(mode="student"))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert (out - base)[~ran].abs().max() > 1e-3 and (out - base)[ran].abs().max() == 0


@pytest.mark.parametrize("student", ["threshold", "topk"])
def test_the_forecast_runs_on_the_skipped_tokens_only(student, tokens):
    """The TPN's forecast is computed for skipped tokens alone (not for every token and then masked)."""
    model = build_tiny("stt", skip_update="predicted", **STUDENTS[student])
    layer = model.layers[1]
    seen = []
    layer.transition.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    ctx = RoutingContext(mode="student")
    model(tokens, routing=ctx)
    skipped = (~ctx.layers[1].selected_mask).sum(-1)
    assert 0 < skipped.min() and seen == [int(skipped.max())], (seen, skipped)


@pytest.mark.parametrize("skip_update", ["predicted", "bias"])
def test_skip_update_decode_matches_full_forward(skip_update, tokens):
    model = build_tiny("stt", skip_update=skip_update, student_threshold=0.5)
    with torch.no_grad():  # a forecast / bias that is not ~0, so the skip update is visible
        for layer in model.layers:
            if isinstance(layer, RoutedSelfAttentionLayer) and skip_update == "predicted":
                layer.transition.down_proj.weight.mul_(50)
            elif isinstance(layer, RoutedSelfAttentionLayer):
                layer.skip_bias.update.normal_(0.0, 0.5)
    full = model(tokens)
    model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    incremental, _ = decode_incrementally(model, tokens, prompt_len=9)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)


def test_predicted_skip_update_trains_the_tpn_through_the_lm_loss(tokens):
    model = build_tiny("stt", skip_update="predicted").train()
    ctx = RoutingContext(mode="teacher", **SURPRISE_BETAS)
    model(tokens, routing=ctx).float().logsumexp(-1).mean().backward()
    assert model.layers[1].transition.up_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", ["mod", "sdt"])
def test_predicted_skip_update_needs_a_forecast(variant):
    with pytest.raises(ValueError, match="skip_update: predicted needs a forecast"):
        build_tiny(variant, skip_update="predicted")


# ---- learned constant update on the skip path (skip_update: bias) -------------------------------------


@pytest.mark.parametrize("variant", ["mod", "sdt", "stt"])
def test_skip_bias_starts_as_no_skip_update_and_adds_its_vector_to_skipped_tokens_only(variant, tokens):
    plain = build_tiny(variant)
    biased = build_tiny(variant, skip_update="bias")
    missing, unexpected = biased.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(".skip_bias.update" in key for key in missing)
    torch.testing.assert_close(biased(tokens), plain(tokens), rtol=0, atol=0)  # zero at initialisation

    index = next(i for i, layer in enumerate(biased.layers) if isinstance(layer, RoutedSelfAttentionLayer))
    layer = biased.layers[index]
    vector = torch.linspace(-1.0, 1.0, layer.skip_bias.update.numel())
    with torch.no_grad():
        layer.skip_bias.update.copy_(vector)
    x = layer_inputs(plain, tokens, index)
    ctx = RoutingContext(mode="student")
    base = plain.layers[index](x, routing=ctx)
    ran = ctx.layers[index].selected_mask
    assert 0 < ran.sum() < ran.numel()
    out = layer(x, routing=RoutingContext(mode="student"))
    torch.testing.assert_close(out[~ran], base[~ran] + vector, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[ran], base[ran])


def test_skip_bias_learns_from_the_lm_loss_in_the_routers_group(tokens):
    from torchtune_dtf.modules import routing_group_of

    model = build_tiny("mod", skip_update="bias").train()
    model(tokens, routing=RoutingContext(mode="teacher")).float().logsumexp(-1).mean().backward()
    names = [name for name, _ in model.named_parameters() if ".skip_bias." in name]
    assert names and all(routing_group_of(name) == "routers" for name in names)
    grads = [param.grad for name, param in model.named_parameters() if ".skip_bias." in name]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


# ---- capacity curriculum -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mod", "stt", "random"])
def test_capacity_progress_moves_the_teacher_budget_from_all_to_gamma(variant):
    model = build_tiny(variant, capacity=0.25)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    for progress, expected in ((0.0, 40), (0.5, 25), (1.0, 10)):
        ctx = RoutingContext(mode="teacher", capacity_progress=progress, **SURPRISE_BETAS)
        model(tokens, routing=ctx)
        for record in ctx.layers.values():
            assert record.selected_mask.sum(-1).tolist() == [expected, expected]


def test_capacity_curriculum_progress_is_linear_to_one_and_bounded():
    curriculum = CapacityCurriculum(ramp_steps=10)
    assert [curriculum.progress(s) for s in (0, 5, 10, 20)] == [0.0, 0.5, 1.0, 1.0]
    assert CapacityCurriculum(ramp_steps=0).progress(0) == 1.0
    with pytest.raises(ValueError, match="ramp_steps must be an integer"):
        CapacityCurriculum(ramp_steps=-1)
    with pytest.raises(ValueError, match="capacity_progress must be in"):
        RoutingContext(mode="teacher", capacity_progress=1.5)


# ---- distillation ------------------------------------------------------------------------------------


def test_distillation_loss_is_the_masked_tempered_kl():
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 6, 11, generator=gen), torch.randn(2, 6, 11, generator=gen)
    labels = torch.tensor([[1, 2, -100, 3, 4, 5], [-100, -100, 1, 2, 3, 4]])
    t = 2.0
    p = torch.softmax(teacher / t, -1)
    kl = (p * (p.log() - torch.log_softmax(student / t, -1))).sum(-1)
    valid = labels != -100
    expected = t * t * kl[valid].mean()
    torch.testing.assert_close(distillation_loss(student, teacher, labels, t, -100), expected)
    # torchtune's chunked logits give the same value
    chunked = distillation_loss(list(student.chunk(3, 1)), list(teacher.chunk(3, 1)), labels, t, -100)
    torch.testing.assert_close(chunked, expected)
    assert distillation_loss(teacher, teacher, labels, t, -100).abs() < 1e-6
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Distillation(weight=1.0, temperature=0.0)
    assert not Distillation(weight=0.0, temperature=1.0).enabled


# ---- through the recipe ------------------------------------------------------------------------------

from omegaconf import OmegaConf  # noqa: E402

from tests.test_recipe import load_config, read_log, run_recipe, train_assets, workdir  # noqa: E402,F401
from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe  # noqa: E402


def baseline_config(variant, **routing):
    """The tiny STT training config with its model replaced by ``variant`` (component builder)."""
    cfg = load_config("stt_train")
    cfg.model = OmegaConf.create(
        {"_component_": "torchtune_dtf.models.qwen2_5.routed_qwen2", "variant": variant,
         **tiny_architecture(), "vocab_size": 151936, **routing_kwargs(variant, **routing)}
    )
    if variant == "random":
        cfg.student_calibration.batches = 0  # no causal router: the recipe refuses to calibrate one
    return cfg


def test_recipe_trains_random_routing_and_never_updates_dropped_layers(workdir):
    from torchtune_dtf.training import RoutedHFCheckpointer  # noqa: F401  (imported by the config)

    cfg = baseline_config("random")
    recipe = run_recipe(cfg)
    log = read_log(workdir)
    assert recipe.global_step == 4
    assert abs(log[4]["routing/layer_1/teacher_fraction"] - 0.5) < 0.03 and "routing/layer_1/agreement_accuracy" in log[4]
    assert "loss/causal" in log[4] and log[4]["loss/causal"] == 0.0  # no router, nothing to imitate
    shutil_rmtree(workdir / "outputs")

    cfg = baseline_config("layerdrop", dropped_layers=[2])
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    before = {k: v.clone() for k, v in recipe._model.state_dict().items()}
    recipe.train()
    recipe.cleanup()
    after = recipe._model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in after if k.startswith("layers.2."))
    assert not torch.equal(before["layers.1.mlp.w1.weight"], after["layers.1.mlp.w1.weight"])
    assert "beta_ce" not in read_log(workdir)[4]  # trained like the dense model


def shutil_rmtree(path):
    import shutil

    shutil.rmtree(path)


def test_capacity_curriculum_ramps_the_teacher_budget_in_training(workdir):
    cfg = load_config("stt_train", **{"capacity_curriculum.ramp_steps": 4})
    run_recipe(cfg)
    log = read_log(workdir)
    # step s is logged after the optimizer step; its forward ran at progress (s − 1) / 4
    assert [log[s]["capacity_progress"] for s in (1, 2, 3, 4)] == [0.0, 0.25, 0.5, 0.75]
    fractions = [log[s]["routing/layer_1/teacher_fraction"] for s in (1, 3)]
    assert fractions[0] == 1.0 and abs(fractions[1] - 0.75) < 0.03


def test_distillation_uses_a_frozen_dense_teacher_of_the_starting_weights(workdir):
    from tests.conftest import build_tiny  # noqa: F401

    cfg = load_config("stt_train", **{"distillation.weight": 1.0, "distillation.temperature": 2.0})
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    teacher = recipe._dense_teacher
    assert not any(p.requires_grad for p in teacher.parameters())
    assert teacher.variant == "dense" and len(teacher.layers) == 4
    start = {k: v.clone() for k, v in teacher.state_dict().items()}
    # The teacher is the dense model of the starting checkpoint: the routed model in dense mode, before training.
    batch = next(iter(recipe._dataloader))
    with torch.no_grad():
        reference = recipe._model(batch["tokens"], routing=RoutingContext(mode="dense"))
        torch.testing.assert_close(torch.cat(teacher(batch["tokens"]), 1), torch.cat(reference, 1))
    recipe.train()
    recipe.cleanup()
    log = read_log(workdir)
    assert all(math.isfinite(log[s]["loss/distill"]) and log[s]["loss/distill"] > 0 for s in (1, 2, 3, 4))
    assert all(torch.equal(start[k], v) for k, v in teacher.state_dict().items())


def test_distillation_weight_zero_builds_no_teacher(workdir):
    cfg = load_config("stt_train")
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    assert recipe._dense_teacher is None
    loss, parts, _ = recipe._total_loss(next(iter(recipe._dataloader)))
    assert "distill" not in parts


def test_missing_capacity_curriculum_and_distillation_keys_are_named():
    from torchtune_dtf.training.recipe_checks import validate_recipe_config

    cfg = load_config("stt_train")
    del cfg["capacity_curriculum"]
    del cfg["distillation"]
    with pytest.raises(ValueError, match="distillation.*capacity_curriculum|capacity_curriculum.*distillation"):
        validate_recipe_config(cfg)


def test_ce_cu_shares_count_the_teachers_choices(tokens):
    from torchtune_dtf.training.routing_losses import routing_metrics

    model = build_tiny("stt")
    ctx = RoutingContext(mode="teacher", **SURPRISE_BETAS)
    model(tokens, routing=ctx)
    metrics = routing_metrics(ctx)
    record = ctx.layers[1]
    chosen = record.teacher_mask
    assert metrics["routing/layer_1/teacher_ce_share"] == pytest.approx(float((record.ce[chosen] > 0).float().mean()))
    assert metrics["routing/layer_1/teacher_cu_share"] == pytest.approx(float((record.cu[chosen] > 0).float().mean()))
    assert "routing/layer_1/teacher_ce_share" not in routing_metrics(_mod_context(tokens))


def _mod_context(tokens):
    ctx = RoutingContext(mode="teacher")
    build_tiny("mod")(tokens, routing=ctx)
    return ctx
