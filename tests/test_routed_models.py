"""torchtune_dtf.modules.{decoder, layers, routed_block, selection, surprise}: behaviour of the routed models: parity
with dense Qwen2, selection, isolation, causality, gradients."""

import pytest
import torch
import torch.nn.functional as F
from torchtune.models.qwen2 import qwen2
from torchtune.modules import TransformerSelfAttentionLayer

from tests.conftest import ROUTED_VARIANTS, VOCAB, build_tiny, tiny_architecture
from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext, SDTDecisionLayer
from torchtune_dtf.modules.routed_block import routed_block_forward
from torchtune_dtf.modules.selection import mask_selection, topk_selection

BETAS = dict(beta_ce=2.0, beta_cu=3.0)


def teacher_ctx(**kw):
    return RoutingContext(mode="teacher", **BETAS, **kw)


def torchtune_dense_reference(model):
    reference = qwen2(**tiny_architecture())
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    assert all(any(n in k for n in ("router", "transition", "prior_ffn")) for k in unexpected)
    return reference.eval()


def routed_layers(model):
    return [layer for layer in model.layers if isinstance(layer, RoutedSelfAttentionLayer)]


# ---------------------------------------------------------------------------------------------- parity
def test_dense_variant_is_torchtune_qwen2(tokens):
    model = build_tiny("dense")
    reference = torchtune_dense_reference(model)
    assert set(model.state_dict()) == set(reference.state_dict())
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("seq_len", [24, 22])  # a multiple of the chunk count, and not (uneven chunks)
def test_chunked_output_matches_torchtune_values_and_gradients(seq_len):
    """Our one-projection chunked head gives torchtune's chunks, loss and gradients (training path)."""
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    tokens = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(4))
    model = build_tiny("dense").train()
    reference = torchtune_dense_reference(model).train()
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=8)
    results = []
    for m in (model, reference):
        m.set_num_output_chunks(loss_fn.num_output_chunks)
        chunks = m(tokens)
        loss = loss_fn(chunks, labels)
        loss.backward()
        results.append((chunks, loss, {n: p.grad for n, p in m.named_parameters()}))
    (ours, our_loss, our_grads), (theirs, their_loss, their_grads) = results
    assert [c.shape for c in ours] == [c.shape for c in theirs]
    if seq_len % loss_fn.num_output_chunks == 0:
        assert all(c.is_contiguous() for c in ours)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_loss, their_loss, rtol=1e-5, atol=1e-5)
    assert set(our_grads) == set(their_grads)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_all_selected_student_matches_dense(variant, tokens):
    model = build_tiny(variant, student_threshold=0.0)
    reference = torchtune_dense_reference(model)
    ctx = RoutingContext(mode="student", apply_gate=False)
    logits = model(tokens, routing=ctx)
    assert all(bool(r.selected_mask.all()) for r in ctx.layers.values())
    torch.testing.assert_close(logits, reference(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_all_selected_teacher_matches_dense(variant, tokens):
    model = build_tiny(variant, capacity=1.0)
    reference = torchtune_dense_reference(model)
    ctx = teacher_ctx(apply_gate=False)
    logits = model(tokens, routing=ctx)
    assert len(ctx.layers) == 2 and all(bool(r.selected_mask.all()) for r in ctx.layers.values())
    torch.testing.assert_close(logits, reference(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_routing_changes_the_output_when_tokens_skip(variant, tokens):
    model = build_tiny(variant)
    reference = torchtune_dense_reference(model)
    assert not torch.allclose(model(tokens, routing=teacher_ctx()), reference(tokens), atol=1e-3)


def test_gate_scales_attention_and_mlp_together(tokens):
    model = build_tiny("mod", capacity=1.0)
    layer = model.layers[1]
    x = torch.randn(2, 10, 64)
    gate = torch.rand(2, 10)
    selection = topk_selection(torch.zeros(2, 10), 10)
    positions = torch.arange(10).expand(2, 10)
    dense_update = TransformerSelfAttentionLayer.forward(layer, x) - x
    out = routed_block_forward(layer, x, selection, gate, positions=positions)
    torch.testing.assert_close(out, x + gate[..., None] * dense_update, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- selection
def test_topk_selects_exactly_k_with_deterministic_ties():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.5, 0.1, 0.9], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    selection = topk_selection(scores, 3)
    assert selection.mask.sum(-1).tolist() == [3, 3]
    # Row 0: both 0.9s, then the earliest 0.5. Row 1: all tied, the first three positions win.
    assert selection.positions.tolist() == [[0, 1, 5], [0, 1, 2]]
    for _ in range(3):
        assert torch.equal(topk_selection(scores, 3).positions, selection.positions)


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_teacher_topk_runs_floor_gamma_t_tokens_per_row(variant, tokens):
    model = build_tiny(variant, capacity=0.3)
    ctx = teacher_ctx()
    model(tokens, routing=ctx)
    k = int(0.3 * tokens.shape[1])
    for record in ctx.layers.values():
        assert record.teacher_mask.sum(-1).tolist() == [k] * tokens.shape[0]
        assert torch.equal(record.selected_mask, record.teacher_mask)


def test_mask_selection_pads_ragged_rows_and_marks_padding_invalid():
    mask = torch.tensor([[True, False, True, True], [False, False, False, True], [False] * 4])
    selection = mask_selection(mask)
    assert selection.positions.shape == (3, 3)
    assert selection.valid.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert selection.positions[0].tolist() == [0, 2, 3] and selection.positions[1, 0].item() == 3


# ------------------------------------------------------------------------------------------- isolation
@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
@pytest.mark.parametrize("mode", ["teacher", "student"])
def test_no_cross_row_leakage(variant, mode, tokens):
    model = build_tiny(variant, student_threshold=0.5)
    ctx = lambda: teacher_ctx() if mode == "teacher" else RoutingContext(mode="student")  # noqa: E731
    base = model(tokens, routing=ctx())
    changed = tokens.clone()
    changed[1] = torch.randint(0, VOCAB, (tokens.shape[1],), generator=torch.Generator().manual_seed(99))
    out = model(changed, routing=ctx())
    # Ragged student selections pad to the batch's longest row, so kernels see other shapes: allow
    # float reassociation noise, far below what attending to another row would cause.
    torch.testing.assert_close(out[[0, 2]], base[[0, 2]], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out[1], base[1])


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_student_forward_is_causal(variant, tokens):
    model = build_tiny(variant, student_threshold=0.5)
    t = 11
    base = model(tokens)
    changed = tokens.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 17) % VOCAB
    out = model(changed)
    torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


def test_student_routes_a_real_fraction_of_tokens(tokens):
    model = build_tiny("stt", student_threshold=0.5)
    ctx = RoutingContext(mode="student")
    model(tokens, routing=ctx)
    fractions = [r.selected_fraction.item() for r in ctx.layers.values()]
    assert all(0.0 < f < 1.0 for f in fractions), fractions


def test_selected_token_ignores_skipped_token_states():
    model = build_tiny("stt")
    layer = model.layers[1]
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, [0, 3, 4, 8, 11]] = True
    mask[1, [1, 2, 9]] = True
    selection = mask_selection(mask)
    positions = torch.arange(12).expand(2, 12)
    out = routed_block_forward(layer, x, selection, None, positions=positions)
    # Skipped tokens pass through untouched.
    torch.testing.assert_close(out[~mask], x[~mask], rtol=0, atol=0)
    # Perturbing skipped tokens changes nothing at selected ones.
    perturbed = x.clone()
    perturbed[~mask] += 5.0
    out2 = routed_block_forward(layer, perturbed, selection, None, positions=positions)
    torch.testing.assert_close(out2[mask], out[mask], rtol=0, atol=0)
    # Each row equals the dense block run on its selected tokens alone, at their original positions.
    for row in range(2):
        chosen = torch.nonzero(mask[row]).squeeze(-1)
        alone = TransformerSelfAttentionLayer.forward(layer, x[row : row + 1, chosen], input_pos=chosen[None])
        torch.testing.assert_close(out[row, chosen], alone[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_gradients_reach_routing_modules(variant, tokens):
    model = build_tiny(variant).train()
    ctx = teacher_ctx()
    logits = model(tokens, routing=ctx)
    lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    records = list(ctx.layers.values())
    aux = sum(r.causal_loss for r in records)
    if variant != "mod":
        aux = aux + sum(r.pred_loss for r in records)
    (lm_loss + aux).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    expected = ["causal_router.hidden.weight", "causal_router.out.weight"]
    expected += {
        "mod": ["mod_router.proj.weight"],
        "stt": ["transition.gate_proj.weight", "transition.down_proj.weight", "predictive_router.o_ce_raw",
                "predictive_router.m_cu_raw"],
        "sdt": ["predictive_router.o_ce_raw", "predictive_router.m_cu_raw"],
    }[variant]
    for layer_idx in (1, 3):
        for suffix in expected:
            g = grads[f"layers.{layer_idx}.{suffix}"]
            assert g is not None and g.abs().sum() > 0, f"no gradient for layers.{layer_idx}.{suffix}"
        if variant == "sdt":
            g = grads[f"layers.{layer_idx - 1}.prior_ffn.down_proj.weight"]
            assert g is not None and g.abs().sum() > 0


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_auxiliary_losses_send_no_gradient_into_backbone(variant, tokens):
    model = build_tiny(variant).train()
    ctx = teacher_ctx()
    model(tokens, routing=ctx)
    aux = sum(r.causal_loss for r in ctx.layers.values())
    if variant != "mod":
        aux = aux + sum(r.pred_loss for r in ctx.layers.values())
    aux.backward()
    routing_names = ("router", "transition", "prior_ffn")
    touched = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert touched, "auxiliary losses trained nothing"
    assert all(any(r in n for r in routing_names) for n in touched), touched


# ------------------------------------------------------------------------------------------ surprise
def test_beta_is_used_as_given(tokens):
    model = build_tiny("stt")
    records = []
    for beta_ce, beta_cu in [(0.1, 0.1), (50.0, 7.0)]:
        ctx = RoutingContext(mode="teacher", beta_ce=beta_ce, beta_cu=beta_cu)
        model(tokens, routing=ctx)
        r = ctx.layers[1]
        torch.testing.assert_close(r.s_ce, torch.sigmoid(beta_ce * r.ce))
        torch.testing.assert_close(r.s_cu, torch.sigmoid(beta_cu * r.cu))
        torch.testing.assert_close(r.g, r.s_ce + r.s_cu - r.s_ce * r.s_cu)
        records.append(r)
    assert not torch.allclose(records[0].g, records[1].g)


def test_teacher_mode_without_beta_fails(tokens):
    with pytest.raises(ValueError, match="beta_ce and beta_cu"):
        build_tiny("stt")(tokens, routing=RoutingContext(mode="teacher"))


def test_dynamic_capacity_stt_selects_by_gate_threshold(tokens):
    betas = dict(beta_ce=20.0, beta_cu=20.0)
    probe = RoutingContext(mode="teacher", **betas)
    build_tiny("stt")(tokens, routing=probe)
    threshold = probe.layers[1].g.median().item()  # a threshold inside g's range at this init
    model = build_tiny("stt", teacher_selection="threshold", gate_threshold=threshold)
    ctx = RoutingContext(mode="teacher", **betas)
    model(tokens, routing=ctx)
    record = ctx.layers[1]
    assert torch.equal(record.teacher_mask, record.g >= threshold)
    assert torch.equal(record.selected_mask, record.teacher_mask)
    counts = record.teacher_mask.sum(-1).tolist()
    assert len(set(counts)) > 1, f"dynamic capacity should let rows differ, got {counts}"
    assert 0 <= record.g_mean.item() <= 1


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_activation_checkpointing_keeps_gradients(variant, tokens):
    from torchtune.training import set_activation_checkpointing

    def grads(model):
        ctx = teacher_ctx()
        logits = model(tokens, routing=ctx)
        loss = logits.logsumexp(-1).mean() + sum(r.causal_loss for r in ctx.layers.values())
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(build_tiny(variant).train())
    wrapped_model = build_tiny(variant).train()
    set_activation_checkpointing(wrapped_model, auto_wrap_policy={TransformerSelfAttentionLayer})
    wrapped = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads(wrapped_model).items()}
    assert plain.keys() == wrapped.keys()
    for name in plain:
        torch.testing.assert_close(wrapped[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)
