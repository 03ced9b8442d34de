"""torchtune_dtf.modules.{surprise, selection, layers, routers}, torchtune_dtf.{data.collate, models.routing_config, training.schedules}:
routing that means what it says (docs/design.md R1–R5): rankings that carry the surprise signal in the dtype
and at the β real configs reach, one gate semantics for training and inference, packed documents routed
as if alone, student modes that refuse to do nothing or to cheat, pads that never take a budget slot."""

import math

import pytest
import torch
import torch.nn.functional as F
from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask
from torchtune.modules.common_utils import delete_kv_caches

from tests.conftest import MOD_ROUTING, ROUTED_VARIANTS, SURPRISE_ROUTING, VOCAB, build_tiny
from torchtune_dtf.data.collate import padded_collate_packed_dense
from torchtune_dtf.models import validate_routing
from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext
from torchtune_dtf.modules.selection import (
    mask_selection,
    row_selection,
    scatter_updates,
    segment_topk_selection,
    sequence_bounds,
    topk_selection,
    window_topk_mask,
)
from torchtune_dtf.modules.layers import sequence_starts
from torchtune_dtf.modules.surprise import causal_moving_average, gate_rank_score, static_surprise
from torchtune_dtf.training.schedules import ScheduledSampling

BETA = 100.0  # the end of every shipped β schedule


def routed_layers(model):
    return [layer for layer in model.layers if isinstance(layer, RoutedSelfAttentionLayer)]


def teacher(beta=BETA, **kwargs):
    return RoutingContext(mode="teacher", beta_ce=beta, beta_cu=beta, **kwargs)


def float64_moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    return torch.stack(
        [torch.stack([values[b, max(0, t - window + 1) : t + 1].mean() for t in range(values.shape[1])])
         for b in range(values.shape[0])]
    )


def float64_rank_score(record, layer) -> torch.Tensor:
    """−log(1 − g) in float64 from the layer's recorded surprise (exact up to exp underflow at −745)."""
    d_st, d_ch = record.d_st.double(), record.d_ch.double()
    ce = d_st - (d_ch - torch.log(record.o_ce.double()))
    cu = d_st - record.m_cu.double() * float64_moving_average(d_st, layer.predictive_router.ma_window)
    return F.softplus(BETA * ce) + F.softplus(BETA * cu)


def float64_topk_mask(score: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(score, dtype=torch.bool).scatter_(1, order, True)


# ------------------------------------------------------------------------------------- R1: ranking
def test_rank_score_orders_like_float64_across_both_tails():
    gen = torch.Generator().manual_seed(0)
    # a = β·CE, b = β·CU from deep negative (g underflows to 0) to large positive (g == 1.0 in fp32).
    a = (torch.rand(4000, generator=gen, dtype=torch.float64) * 2 - 1) * 1000
    b = (torch.rand(4000, generator=gen, dtype=torch.float64) * 2 - 1) * 1000
    g32 = 1 - torch.sigmoid(-a.float()) * torch.sigmoid(-b.float())
    assert (g32 == 1.0).float().mean() > 0.4 and (g32 == 0.0).float().mean() > 0.1  # both tails saturate
    def log_softplus(z):  # float64; softplus(z) = e^z to double precision below −40
        return torch.where(z < -40, z, F.softplus(z).log())

    exact = torch.logaddexp(log_softplus(a), log_softplus(b))  # log(−log(1 − g)), float64
    score = gate_rank_score(a.float(), b.float())
    assert torch.equal(torch.argsort(score, stable=True), torch.argsort(exact, stable=True))
    assert score.numel() - score.unique().numel() <= 4  # fp32 collisions only (ulp 6e-5 at 1000), not plateaus


def test_surprise_is_computed_in_fp32_from_bf16_residuals():
    delta = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 3
    d_st = static_surprise(delta)
    assert d_st.dtype == torch.float32
    torch.testing.assert_close(d_st, delta.double().pow(2).mean(-1).float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_teacher_topk_follows_the_float64_surprise_not_position(dtype, tokens):
    # o_ce = 2 puts β·CE ≈ 100·log 2 ≈ 69 for every token: σ(β·CE), and g, equal 1 to fp32 precision, so a
    # top-k over g would be decided by rounding and the tie rule — the first half of every row.
    model = build_tiny("stt", o_ce_init=2.0).to(dtype)
    ctx = teacher()
    with torch.no_grad():
        model(tokens, routing=ctx)
    for layer in routed_layers(model):
        record = ctx.layers[layer.layer_idx]
        saturated = (record.g >= 1 - 1e-7).float().mean()
        assert saturated > 0.9, "the inputs do not saturate g; the test would prove nothing"
        k = layer.num_selected(tokens.shape[1])
        expected = float64_topk_mask(float64_rank_score(record, layer), k)
        assert torch.equal(record.teacher_mask, expected)
        assert not torch.equal(record.teacher_mask, float64_topk_mask(torch.zeros_like(record.g), k)), (
            "selection is position order")
        ties = record.score.shape[1] - torch.tensor([row.unique().numel() for row in record.score])
        assert int(ties.sum()) == 0


def test_surprise_under_bf16_matches_fp32(tokens):
    fp32, bf16 = build_tiny("stt"), build_tiny("stt").to(torch.bfloat16)
    ctx32, ctx16 = teacher(beta=5.0), teacher(beta=5.0)
    with torch.no_grad():
        fp32(tokens, routing=ctx32)
        bf16(tokens, routing=ctx16)
    for idx, record in ctx32.layers.items():
        other = ctx16.layers[idx]
        for name in ("d_st", "d_ch", "ce", "cu", "g"):
            value = getattr(other, name)
            assert value.dtype == torch.float32, name
            torch.testing.assert_close(value, getattr(record, name), rtol=0.05, atol=0.02)


def test_teacher_threshold_compares_the_unsaturated_score(tokens):
    # g_th = 1 − e^−17 is finer than fp32 can resolve near 1; o_ce = 1.18 puts −log(1 − g) around 17.
    # Comparing g itself would admit tokens whose g merely rounds up to g_th.
    g_th = 1 - math.exp(-17)
    model = build_tiny("stt", o_ce_init=1.1806, teacher_selection="threshold", gate_threshold=g_th)
    ctx = teacher()
    with torch.no_grad():
        model(tokens, routing=ctx)
    discriminating = False
    for layer in routed_layers(model):
        record = ctx.layers[layer.layer_idx]
        expected = float64_rank_score(record, layer) >= 17
        assert torch.equal(record.teacher_mask, expected)
        discriminating |= not torch.equal(record.g >= torch.tensor(g_th, dtype=torch.float32), expected)
        assert 0 < int(expected.sum()) < expected.numel()
    assert discriminating, "fp32 g ≥ g_th agreed with the exact test everywhere; the inputs prove nothing"


def test_mod_router_ranks_bf16_inputs_without_ties(tokens):
    model = build_tiny("mod").to(torch.bfloat16)
    layer = routed_layers(model)[0]
    captured = {}
    layer.register_forward_pre_hook(lambda mod, args: captured.__setitem__("x", args[0]))
    ctx = teacher()
    with torch.no_grad():
        model(tokens, routing=ctx)
    record = ctx.layers[layer.layer_idx]
    assert record.router_logits.dtype == torch.float32
    exact = captured["x"].double() @ layer.mod_router.proj.weight.double().T
    expected = float64_topk_mask(exact.squeeze(-1), layer.num_selected(tokens.shape[1]))
    assert torch.equal(record.teacher_mask, expected)
    # The same logits rounded to bf16 would tie: what fp32 logits avoid.
    assert record.router_logits.to(torch.bfloat16).unique().numel() < record.router_logits.numel()
    assert record.router_logits.unique().numel() == record.router_logits.numel()


def test_student_threshold_compares_logits_not_saturated_probabilities(tokens):
    tau = 1 - 1e-7  # logit(τ) ≈ 16.1: σ(r̃) rounds to 1.0 in fp32 from r̃ ≈ 16.6 on
    model = build_tiny("stt", student_threshold=tau)
    layers = routed_layers(model)
    for layer in layers:
        with torch.no_grad():
            layer.causal_router.out.weight.mul_(200.0)
            layer.causal_router.out.bias.fill_(16.0)
    ctx = RoutingContext(mode="student")
    with torch.no_grad():
        model(tokens, routing=ctx)
    discriminating = False
    for layer in layers:
        record = ctx.layers[layer.layer_idx]
        expected = torch.sigmoid(record.student_logits.double()) > tau
        assert torch.equal(record.selected_mask, expected)
        discriminating |= not torch.equal(torch.sigmoid(record.student_logits) > tau, expected)
    assert discriminating, "fp32 σ(r̃) > τ agreed everywhere; the inputs prove nothing"


# ----------------------------------------------------------------------------------------- R2: gate
@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_straight_through_training_forward_is_the_inference_forward(variant, tokens):
    model = build_tiny(variant, gate="straight_through")
    with torch.no_grad():
        deployed = model(tokens, routing=RoutingContext(mode="student"))
    ctx = teacher(beta=5.0, execute="student")
    trained = model(tokens, routing=ctx)
    torch.testing.assert_close(trained, deployed, rtol=0, atol=1e-5)
    # The gate still carries a gradient to what decides it (o_ce/m_cu for SDT/STT, the MoD router).
    F.cross_entropy(trained[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    layer = routed_layers(model)[0]
    decider = layer.mod_router.proj.weight if variant == "mod" else layer.predictive_router.o_ce_raw
    assert decider.grad is not None and decider.grad.abs().sum() > 0

    # With the papers' scaled gate, the same selections give a different forward: training ≠ inference.
    scaled = build_tiny(variant, gate="scaled")
    with torch.no_grad():
        differs = scaled(tokens, routing=teacher(beta=5.0, execute="student"))
        if variant == "mod":
            # MoD's scaled gate is causal, so inference applies σ(r) too and the two agree.
            torch.testing.assert_close(differs, scaled(tokens), rtol=0, atol=1e-5)
        else:
            assert (differs - scaled(tokens)).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_scheduled_sampling_runs_the_students_mask(variant, tokens):
    model = build_tiny(variant)
    ctx = teacher(beta=5.0, execute="student")
    with torch.no_grad():
        model(tokens, routing=ctx)
    for record in ctx.layers.values():
        assert torch.equal(record.selected_mask, record.student_mask)
        assert not torch.equal(record.selected_mask, record.teacher_mask)  # targets stay the teacher's


def test_scheduled_sampling_schedule_is_deterministic_and_ramps():
    schedule = ScheduledSampling(share_start=0.0, share_end=0.5, ramp_steps=100)
    assert schedule.share(0) == 0.0 and schedule.share(50) == 0.25 and schedule.share(500) == 0.5
    draws = [schedule.executes_student(step, seed=3) for step in range(100, 2100)]
    assert draws == [schedule.executes_student(step, seed=3) for step in range(100, 2100)]  # resumable
    assert abs(sum(draws) / len(draws) - 0.5) < 0.05
    assert not any(schedule.executes_student(0, seed) for seed in range(20))
    assert all(ScheduledSampling(1.0, 1.0, 0).executes_student(step, 0) for step in range(20))
    with pytest.raises(ValueError, match="share_end must be in"):
        ScheduledSampling(0.0, 1.5, 0)


# ------------------------------------------------------------------------------------ R3: packing
def _pack(documents, pad_len, pad_id=0):
    """A torchtune PackedDataset pack: documents back to back, positions restarting per document, then
    padding whose positions run on from the last document (as ``PackedDataset._pad_pack`` writes them)."""
    tokens = torch.cat([*documents, torch.full((pad_len,), pad_id)])
    positions = torch.cat([torch.arange(len(d)) for d in documents])
    positions = torch.cat([positions, positions[-1] + 1 + torch.arange(pad_len)])
    seq_lens = torch.tensor([len(d) for d in documents] + [pad_len])
    return {"tokens": tokens, "labels": tokens, "input_pos": positions, "seq_lens": seq_lens}


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
@pytest.mark.parametrize("mode", ["teacher", "student"])
def test_packed_documents_route_as_if_alone(variant, mode):
    gen = torch.Generator().manual_seed(11)
    documents = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (10, 14)]
    batch = padded_collate_packed_dense([_pack(documents, pad_len=4), _pack(documents[::-1], pad_len=4)])
    model = build_tiny(variant)
    make_ctx = (lambda: teacher(beta=5.0)) if mode == "teacher" else (lambda: RoutingContext(mode="student"))
    packed_ctx = make_ctx()
    with torch.no_grad():
        packed = model(batch["tokens"], mask=batch["mask"], input_pos=batch["input_pos"], routing=packed_ctx)
    for row, order in ((0, (0, 1)), (1, (1, 0))):
        start = 0
        for doc_index in order:
            doc = documents[doc_index]
            span = slice(start, start + len(doc))
            alone_ctx = make_ctx()
            with torch.no_grad():
                alone = model(doc[None], routing=alone_ctx)
            torch.testing.assert_close(packed[row, span], alone[0], rtol=1e-4, atol=1e-4)
            for idx, record in alone_ctx.layers.items():
                packed_record = packed_ctx.layers[idx]
                assert torch.equal(packed_record.selected_mask[row, span], record.selected_mask[0])
                for name in ("d_st", "d_ch", "ce", "cu", "g"):
                    if getattr(record, name) is not None:
                        torch.testing.assert_close(getattr(packed_record, name)[row, span], getattr(record, name)[0],
                                                   rtol=1e-4, atol=1e-5)
            start += len(doc)


def test_packed_collate_gives_torchtunes_block_causal_mask():
    batch = padded_collate_packed_dense([_pack([torch.arange(1, 4), torch.arange(1, 3)], pad_len=1)])
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(batch["mask"][0], expected)
    assert batch["input_pos"][0].tolist() == [0, 1, 2, 0, 1, 2]


def test_segment_topk_gives_each_packed_sequence_its_own_budget():
    starts = torch.tensor([[True, False, False, True, False, False, False, True, False]])
    first, length = sequence_bounds(starts)
    assert first.tolist() == [[0, 0, 0, 3, 3, 3, 3, 7, 7]] and length.tolist() == [[3, 3, 3, 4, 4, 4, 4, 2, 2]]
    scores = torch.tensor([[0.0, 5.0, 1.0, 9.0, 2.0, 2.0, 0.0, 3.0, 4.0]])
    selection = segment_topk_selection(scores, starts, 0.5)  # ⌊1.5⌋ = 1, ⌊2⌋ = 2, ⌊1⌋ = 1
    assert torch.nonzero(selection.mask[0]).squeeze(-1).tolist() == [1, 3, 4, 8]  # the 2.0 tie: earlier wins


def _added_token_by_token(x, selection, update):
    """The reference of :func:`scatter_updates`: the k-th real slot of a row goes to its k-th selected token."""
    out = x.clone()
    for row in range(x.shape[0]):
        for slot in range(selection.positions.shape[1]):
            if selection.valid is None or selection.valid[row, slot]:
                out[row, selection.positions[row, slot]] += update[row, slot]
    return out


def test_updates_land_on_the_selected_tokens_once_and_carry_their_gradient():
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(3, 10, generator=gen)
    ragged = scores > 0.3  # rows select different numbers of tokens: padded slots must add nothing
    ragged[1] = False  # and a row may select none
    for selection in (topk_selection(scores, 4), mask_selection(ragged)):
        x = torch.randn(3, 10, 5, generator=gen, requires_grad=True)
        update = torch.randn(3, selection.num_selected, 5, generator=gen, requires_grad=True)
        out = scatter_updates(x, selection, update)
        expected = _added_token_by_token(x, selection, update)
        assert torch.equal(out, expected)
        weights = torch.randn(out.shape, generator=gen)
        grads = torch.autograd.grad((out * weights).sum(), (x, update))
        expected_grads = torch.autograd.grad((expected * weights).sum(), (x, update))
        for got, want in zip(grads, expected_grads):
            assert torch.equal(got, want)
    # A decode step of some rows: x holds the running rows only, the selection's mask the whole batch.
    steps = row_selection(torch.tensor([[True], [False], [True]]), 2)
    x_rows, update = torch.randn(2, 1, 5, generator=gen), torch.randn(2, 1, 5, generator=gen)
    assert torch.equal(scatter_updates(x_rows, steps, update), x_rows + update)


# --------------------------------------------------------------------- R4: masks, padding, budgets
def test_left_pads_never_take_a_topk_slot():
    # The case: 11 real tokens after 13 pads. A row's budget is γ·11, and pads never compete for it.
    model = build_tiny("stt", student_routing_mode="topk", student_threshold=None)
    gen = torch.Generator().manual_seed(4)
    short, full = torch.randint(1, VOCAB, (11,), generator=gen), torch.randint(1, VOCAB, (24,), generator=gen)
    batch = torch.stack([torch.cat([torch.zeros(13, dtype=torch.long), short]), full])
    padding = batch != 0
    model.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=32)
    ctx = RoutingContext(mode="student")
    with torch.no_grad():
        together = model(batch, mask=get_causal_mask_from_padding_mask(padding, 32),
                         input_pos=get_position_ids_from_padding_mask(padding), routing=ctx)
    delete_kv_caches(model)
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=32)
    alone_ctx = RoutingContext(mode="student")
    with torch.no_grad():
        alone = model(short[None], mask=torch.tril(torch.ones(11, 32, dtype=torch.bool))[None],
                      input_pos=torch.arange(11), routing=alone_ctx)
    torch.testing.assert_close(together[0, 13:], alone[0], rtol=1e-4, atol=1e-4)
    for idx, record in ctx.layers.items():
        assert not record.selected_mask[0, :13].any(), "a pad took a slot"
        assert record.selected_mask[0, 13:].sum() == 5 == math.floor(0.5 * 11)
        assert torch.equal(record.selected_mask[0, 13:], alone_ctx.layers[idx].selected_mask[0])
        assert record.selected_mask[1].sum() == 12


# ------------------------------------------------------------------ R5: placement and first token
@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_always_run_first_token_counts_in_the_capacity(variant, tokens):
    model = build_tiny(variant, always_run_first_token=True)
    ctx = teacher(beta=5.0)
    with torch.no_grad():
        model(tokens, routing=ctx)
        student = RoutingContext(mode="student")
        model(tokens, routing=student)
    for idx, record in ctx.layers.items():
        assert record.teacher_mask[:, 0].all()
        assert record.teacher_mask.sum(-1).tolist() == [12, 12, 12]  # still ⌊γ·24⌋ per row
        assert student.layers[idx].selected_mask[:, 0].all()
    baseline = RoutingContext(mode="teacher", beta_ce=5.0, beta_cu=5.0)
    with torch.no_grad():
        build_tiny(variant)(tokens, routing=baseline)
    assert not all(bool(r.teacher_mask[:, 0].all()) for r in baseline.layers.values()), (
        "position 0 is always selected anyway; the option would prove nothing")


def test_named_placements_resolve_and_unknown_or_empty_ones_are_rejected():
    inner = validate_routing("stt", 30, **_routing(routed_layers="every_other_inner"))
    assert inner.routed_layers == list(range(1, 28, 2)) and 29 not in inner.routed_layers
    assert validate_routing("stt", 30, **_routing(routed_layers="every_other")).routed_layers[-1] == 29
    with pytest.raises(ValueError, match="every_other_inner"):
        validate_routing("stt", 30, **_routing(routed_layers="every_third"))
    with pytest.raises(ValueError, match="resolves to no layer"):
        validate_routing("stt", 2, **_routing(routed_layers="every_other_inner"))


def _routing(**overrides):
    return {**SURPRISE_ROUTING, **overrides}


@pytest.mark.parametrize("key, value, message", [
    ("gate", "halfway", "unknown gate 'halfway'"),
    ("always_run_first_token", "yes", "always_run_first_token must be True or False"),
    ("allow_noncausal_student_topk", 1, "allow_noncausal_student_topk must be True or False"),
])
def test_bad_gate_and_boolean_routing_values_are_rejected(key, value, message):
    with pytest.raises(ValueError, match=message):
        validate_routing("mod", 4, **{**MOD_ROUTING, key: value})


def test_missing_gate_and_first_token_keys_are_named():
    routing = {k: v for k, v in MOD_ROUTING.items() if k not in ("gate", "always_run_first_token")}
    with pytest.raises(ValueError, match="missing required routing hyperparameter.*gate, always_run_first_token"):
        validate_routing("mod", 4, **routing)


def test_moving_average_restarts_at_every_sequence_start():
    values = torch.rand(1, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    starts = torch.zeros(1, 12, dtype=torch.bool)
    starts[0, [0, 5, 9]] = True
    got = causal_moving_average(values, 3, starts)
    pieces = [causal_moving_average(values[:, a:b], 3) for a, b in ((0, 5), (5, 9), (9, 12))]
    torch.testing.assert_close(got, torch.cat(pieces, dim=1), rtol=1e-6, atol=0)


def test_sequence_starts_mark_pads_first_tokens_and_packed_documents():
    padding = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    starts = sequence_starts(get_position_ids_from_padding_mask(padding),
                             get_causal_mask_from_padding_mask(padding, 5), 0)
    # Each pad, and the first real token after them, has no predecessor; an unpadded row starts once.
    assert starts.tolist() == [[True, True, True, False, False], [True, False, False, False, False]]
    packed = padded_collate_packed_dense([_pack([torch.arange(1, 4), torch.arange(1, 3)], pad_len=2)])
    starts = sequence_starts(packed["input_pos"], packed["mask"], 0)
    assert starts.tolist() == [[True, False, False, True, False, True, False]]  # the pad block starts too


def test_per_layer_capacity_follows_the_layers_in_the_order_the_config_lists_them():
    # A placement written by block influence is not sorted; each γ must stay with its own layer.
    spec = validate_routing("stt", 30, **_routing(routed_layers=[14, 2, 25], capacity=[0.25, 0.75, 0.5]))
    assert spec.routed_layers == [2, 14, 25]
    assert dict(zip(spec.routed_layers, spec.capacity)) == {14: 0.25, 2: 0.75, 25: 0.5}
    named = validate_routing("stt", 8, **_routing(routed_layers="every_other_inner", capacity=[0.25, 0.5, 0.75]))
    assert dict(zip(named.routed_layers, named.capacity)) == {1: 0.25, 3: 0.5, 5: 0.75}


# ------------------------------------------------------------------------------------------------
# Window top-k students: a causal budget that holds on any text
# ------------------------------------------------------------------------------------------------
def reference_window_topk(scores, starts, capacity, width):
    """Token by token, as written in the docstring: t runs when its mid-rank among the n_t tokens of its
    sequence among the last `width` (t included) is below γ·n_t."""
    batch, seq_len = scores.shape
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for b in range(batch):
        first = 0
        for t in range(seq_len):
            first = t if (t == 0 or starts[b, t]) else first
            window = scores[b, max(first, t - width + 1): t + 1]
            mid_rank = int((window > scores[b, t]).sum()) + 0.5 * int((window == scores[b, t]).sum())
            mask[b, t] = mid_rank < capacity * window.numel()
    return mask


def test_window_topk_is_the_token_by_token_rule_and_carries_its_window_across_chunks():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 41, generator=gen)
    starts = torch.zeros(3, 41, dtype=torch.bool)
    starts[:, 0] = True
    starts[1, 17] = starts[2, 5] = starts[2, 6] = True  # packed documents, and a one-token sequence
    width, capacity = 8, 0.375
    expected = reference_window_topk(scores, starts, capacity, width)
    empty = torch.zeros(3, width - 1), torch.zeros(3, width - 1, dtype=torch.bool)
    whole, _, _ = window_topk_mask(scores, starts, capacity, *empty)
    assert torch.equal(whole, expected)
    # In chunks (a prefill, then single tokens and a short chunk), carrying the window: the same decisions.
    recent, recent_valid = empty
    pieces = []
    for lo, hi in ((0, 12), (12, 13), (13, 14), (14, 30), (30, 41)):
        chunk, recent, recent_valid = window_topk_mask(scores[:, lo:hi], starts[:, lo:hi], capacity, recent, recent_valid)
        pieces.append(chunk)
    assert torch.equal(torch.cat(pieces, dim=1), expected)
    # Not position order, not everything: a ranking of the scores.
    assert 0.25 < expected.float().mean() < 0.5 and not torch.equal(expected[0], expected[1])


def test_window_topk_holds_the_budget_where_a_calibrated_threshold_does_not():
    """bf16 scores, a 64-token window: when the scores shift (a model's own generations are scored unlike the
    text a threshold was calibrated on) the threshold's executed fraction follows the shift and the window
    top-k's stays at γ."""
    torch.manual_seed(0)
    capacity, width = 0.5, 64
    calibration = torch.randn(4, 512).bfloat16().float()
    threshold = torch.quantile(calibration, 1 - capacity)
    drifted = (torch.randn(4, 512) + 1.5).bfloat16().float()  # text the router scores higher
    starts = torch.zeros(4, 512, dtype=torch.bool)
    starts[:, 0] = True
    empty = torch.zeros(4, width - 1), torch.zeros(4, width - 1, dtype=torch.bool)
    for scores, label in ((calibration, "calibration text"), (drifted, "drifted text")):
        window, _, _ = window_topk_mask(scores, starts, capacity, *empty)
        assert abs(window.float().mean() - capacity) < 0.03, label
    assert (drifted > threshold).float().mean() > 0.85  # the fixed threshold runs most of the shifted text
    window, _, _ = window_topk_mask(drifted, starts, capacity, *empty)
    assert torch.equal(window, reference_window_topk(drifted, starts, capacity, width))


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_window_topk_student_runs_its_budget_and_is_causal(variant, tokens):
    model = build_tiny(variant, student_routing_mode="window_topk", student_threshold=None, student_window=6)
    ctx = RoutingContext(mode="student")
    model(tokens, routing=ctx)
    prefix = tokens.shape[1] // 2
    ctx_prefix = RoutingContext(mode="student")
    model(tokens[:, :prefix], routing=ctx_prefix)
    for layer in routed_layers(model):
        record = ctx.layers[layer.layer_idx]
        starts = torch.zeros_like(record.selected_mask)
        starts[:, 0] = True  # one sequence per row; the tiny configs do not force the first token
        expected = reference_window_topk(record.student_logits, starts, layer.capacity, 6)
        assert torch.equal(record.selected_mask, expected)
        assert 0 < record.selected_mask.float().mean() < 1
        # Causal: the decisions on a prefix are the decisions of the whole text on that prefix.
        assert torch.equal(ctx_prefix.layers[layer.layer_idx].selected_mask, record.selected_mask[:, :prefix])


def test_window_topk_needs_its_window():
    with pytest.raises(ValueError, match="student_window must be an integer ≥ 2"):
        validate_routing("stt", 4, **_routing(student_routing_mode="window_topk", student_threshold=None, student_window=1))
    with pytest.raises(ValueError, match="missing required routing hyperparameter.*student_window"):
        routing = _routing()
        routing.pop("student_window")
        validate_routing("stt", 4, **routing)
