"""torchtune_dtf.modules.{predictors, surprise, routers}, torchtune_dtf.models.{routing_config, qwen2_5}: components in
isolation: predictors, surprise math, routers, validation of routing hyperparameters, parameter counts."""

import math

import pytest
import torch
import torch.nn.functional as F
from torchtune.modules.peft import get_adapter_params

from tests.conftest import MAX_SEQ_LEN, MOD_ROUTING, SURPRISE_ROUTING, VOCAB
from torchtune_dtf.models import validate_routing
from torchtune_dtf.models.qwen2_5 import lora_stt_qwen2_5_tiny, stt_qwen2_5_0_5b, stt_qwen2_5_tiny
from torchtune_dtf.modules import (
    CausalRouter,
    PredictiveRouter,
    causal_moving_average,
    predictor_width,
    previous_token_states,
)


def test_predictor_width_is_ceil_f_d_rounded_up_to_even():
    assert predictor_width(0.0625, 896) == 56  # Qwen2.5-0.5B at f = 0.0625 (docs/design.md §3.3)
    assert predictor_width(0.0001, 64) == 2
    assert predictor_width(0.1, 64) == 8  # ceil(6.4) = 7 → rounded up to even


def test_softplus_parameters_start_at_configured_values():
    router = PredictiveRouter(o_ce_init=1.025, m_cu_init=1.1, ma_window=4)
    assert math.isclose(router.o_ce.item(), 1.025, rel_tol=1e-6)
    assert math.isclose(router.m_cu.item(), 1.1, rel_tol=1e-6)
    large = PredictiveRouter(o_ce_init=40.0, m_cu_init=1e-3, ma_window=4)
    assert math.isclose(large.o_ce.item(), 40.0, rel_tol=1e-6) and math.isclose(large.m_cu.item(), 1e-3, rel_tol=1e-4)


def test_moving_average_matches_direct_computation():
    values = torch.rand(2, 13, generator=torch.Generator().manual_seed(0))
    window = 5
    direct = torch.stack(
        [torch.stack([values[b, max(0, t - window + 1) : t + 1].mean() for t in range(13)]) for b in range(2)]
    )
    torch.testing.assert_close(causal_moving_average(values, window), direct)
    # The first tokens average over the history they have.
    torch.testing.assert_close(causal_moving_average(values, window)[:, 0], values[:, 0])


def test_gate_is_the_probabilistic_or_of_the_ce_and_cu_sigmoids():
    router = PredictiveRouter(o_ce_init=1.5, m_cu_init=0.8, ma_window=3)
    d_st = torch.rand(1, 6, generator=torch.Generator().manual_seed(1))
    d_ch = torch.rand(1, 6, generator=torch.Generator().manual_seed(2))
    out = router(d_st, d_ch, beta_ce=4.0, beta_cu=9.0)
    ce = d_st - (d_ch - math.log(1.5))
    cu = d_st - 0.8 * causal_moving_average(d_st, 3)
    torch.testing.assert_close(out.ce, ce)
    torch.testing.assert_close(out.cu, cu)
    s_ce, s_cu = torch.sigmoid(4.0 * ce), torch.sigmoid(9.0 * cu)
    torch.testing.assert_close(out.g, s_ce + s_cu - s_ce * s_cu)
    assert bool(((out.g >= 0) & (out.g <= 1)).all())


def test_previous_token_states_reset_at_sequence_start():
    x = torch.arange(1, 7, dtype=torch.float32).view(1, 6, 1).expand(2, 6, 1).clone()
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])  # row 1: left-padded
    prev = previous_token_states(x, positions == 0)
    assert prev[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert prev[1, :, 0].tolist() == [0, 0, 0, 3, 4, 5]
    carried = previous_token_states(x[:, :1], torch.tensor([[False], [False]]), carried=torch.full((2, 1), 9.0))
    assert carried[:, 0, 0].tolist() == [9.0, 9.0]


def _two_token_router_reference(router, x, positions, carried=None):
    """The spec's definition, written out: MLP([RMSNorm(x_t) ‖ RMSNorm(x_{t−1})]), x_{t−1} = 0 at position 0."""
    previous = previous_token_states(x, positions == 0, carried)
    features = torch.cat([router.norm(x), router.norm(previous)], dim=-1)
    return router.out(torch.nn.functional.silu(router.hidden(features))).squeeze(-1)


def test_two_token_causal_router_uses_the_previous_token():
    router = CausalRouter(embed_dim=8, hidden_dim=4, use_previous_token=True, norm_eps=1e-6, init_std=0.5)
    x = torch.randn(1, 5, 8)
    positions = torch.arange(5)[None]
    base = router(x, positions == 0)
    x2 = x.clone()
    x2[0, 2] += 1.0
    changed = router(x2, positions == 0)
    assert torch.equal(changed[0, :2], base[0, :2]) and torch.equal(changed[0, 4:], base[0, 4:])
    assert not torch.equal(changed[0, 3], base[0, 3])  # token 3 sees token 2 as its predecessor
    with pytest.raises(ValueError, match="where each sequence starts"):
        router(x)


# Without gradients the router scales whichever operand is smaller by the norm's scale: with 6 hidden units
# (12 weight rows) the 12-token calls scale the input, with 2 (4 rows) they fold the scale into the weight; the
# chunks below mix both. With gradients (the first comparison) it always folds.
@pytest.mark.parametrize("hidden_dim", [6, 2], ids=["input_scaled", "weight_folded"])
def test_two_token_causal_router_equals_the_concatenated_reference(hidden_dim):
    torch.manual_seed(0)
    router = CausalRouter(embed_dim=8, hidden_dim=hidden_dim, use_previous_token=True, norm_eps=1e-6, init_std=0.5)
    with torch.no_grad():
        router.norm.scale.uniform_(0.5, 1.5)
        router.hidden.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 6, 8, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])  # row 1: left-padded
    fused = router(x, positions == 0)
    reference = _two_token_router_reference(router, x, positions)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    # Gradients reach the same parameters with the same values.
    grads = torch.autograd.grad(fused.square().sum(), list(router.parameters()) + [x])
    ref_grads = torch.autograd.grad(reference.square().sum(), list(router.parameters()) + [x])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Decoding: a chunk that continues a sequence uses the term its previous chunk's last token handed over,
    # which is that token's input through W_p: the chunks together give the logits of one call over both.
    with torch.no_grad():
        whole = router(x, positions == 0)
        head_logits, carried = router(x[:, :4], positions[:, :4] == 0, return_carried=True)
        assert carried.shape == (2, hidden_dim)
        tail_logits = router(x[:, 4:], positions[:, 4:] == 0, carried)
        torch.testing.assert_close(torch.cat([head_logits, tail_logits], dim=1), whole, rtol=1e-5, atol=1e-6)
        later = torch.tensor([[6, 7], [4, 5]])
        reference = _two_token_router_reference(router, x[:, :2], later, x[:, -1])
        torch.testing.assert_close(router(x[:, :2], later == 0, carried=router(x, positions == 0, return_carried=True)[1]),
                                   reference, rtol=1e-5, atol=1e-6)
        # Without the previous token's input there is nothing to carry.
        single = CausalRouter(embed_dim=8, hidden_dim=hidden_dim, use_previous_token=False, norm_eps=1e-6, init_std=0.5)
        single.norm.scale.uniform_(0.5, 1.5)
        assert single.carry_dim == 0 and single(x, return_carried=True)[1] is None and router.carry_dim == hidden_dim
        single_reference = single.out(torch.nn.functional.silu(single.hidden(single.norm(x)))).squeeze(-1)
        torch.testing.assert_close(single(x), single_reference, rtol=1e-5, atol=1e-6)  # 12 tokens
        torch.testing.assert_close(single(x[:1, :1]), single_reference[:1, :1], rtol=1e-5, atol=1e-6)  # one token


def test_meta_build_of_0_5b_has_the_qwen_parameter_count():
    with torch.device("meta"):
        model = stt_qwen2_5_0_5b(**SURPRISE_ROUTING)
    base = sum(p.numel() for n, p in model.named_parameters() if not any(
        r in n for r in ("router", "transition", "prior_ffn")))
    assert base == 494_032_768  # Qwen2.5-0.5B with tied embeddings
    routing = sum(p.numel() for p in model.parameters()) - base
    # 12 STT layers: TPN (3·896·56 + 896), two-token causal router (896 + 1792·16 + 16 + 16 + 1), o_ce, m_cu.
    assert routing == 12 * ((3 * 896 * 56 + 896) + (896 + 1792 * 16 + 16 + 16 + 1) + 2)


def test_lora_twin_trains_adapters_and_every_routing_parameter():
    model = lora_stt_qwen2_5_tiny(
        ["q_proj", "v_proj"], True, lora_rank=4, lora_alpha=8, lora_dropout=0.0, vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN,
        **SURPRISE_ROUTING,
    )
    adapter = set(get_adapter_params(model))
    routing = {n for n in dict(model.named_parameters()) if any(r in n for r in ("router", "transition"))}
    assert routing and routing <= adapter
    assert any("lora_a" in n for n in adapter) and any("mlp.w1.lora_a" in n or "mlp.w1" in n for n in adapter)
    assert not any(n.endswith("attn.q_proj.weight") for n in adapter)


# ------------------------------------------------------------------------------------------ validation
def test_every_problem_is_reported_at_once():
    bad = dict(SURPRISE_ROUTING, capacity=1.5, ma_window=-3, o_ce_init=0.0, student_routing_mode="sometimes")
    del bad["m_cu_init"]
    with pytest.raises(ValueError) as err:
        stt_qwen2_5_tiny(vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN, **bad)
    message = str(err.value)
    for fragment in ("m_cu_init", "capacity", "ma_window", "o_ce_init", "student_routing_mode"):
        assert fragment in message, message


@pytest.mark.parametrize(
    "variant, change, fragment",
    [
        ("mod", dict(capacity=0.0), "capacity must be in (0, 1]"),
        ("mod", dict(capacity=[0.5, 0.5, 0.5]), "capacity lists 3 values but there are 2 routed layers"),
        ("mod", dict(student_threshold=1.0), "student_threshold"),
        ("mod", dict(causal_router_input="both"), "causal_router_input"),
        ("mod", dict(routed_layers=[1, 7]), "outside [0, 4)"),
        ("mod", dict(prior_factor=0.1), "unknown routing hyperparameter(s) for variant 'mod': prior_factor"),
        ("stt", dict(ma_window=0), "ma_window must be a positive integer"),
        ("stt", dict(m_cu_init=-1.0), "m_cu_init must be positive"),
        ("stt", dict(teacher_selection="threshold", gate_threshold=None), "gate_threshold"),
        ("sdt", dict(routed_layers=[0, 2]), "needs a Decision layer"),
        ("sdt", dict(routed_layers=[1, 2]), "needs a Decision layer"),
        ("moe", {}, "unknown variant 'moe'"),
    ],
)
def test_invalid_routing_is_rejected(variant, change, fragment):
    base = MOD_ROUTING if variant == "mod" else SURPRISE_ROUTING
    with pytest.raises(ValueError) as err:
        validate_routing(variant, 4, **dict(base, **change))
    assert fragment in str(err.value)


def test_missing_keys_are_named():
    with pytest.raises(ValueError, match="missing required routing hyperparameter.*capacity, student_routing_mode"):
        validate_routing("mod", 4, routed_layers="every_other")


def test_per_layer_capacity_list_gives_each_routed_layer_its_value():
    spec = validate_routing("mod", 4, **dict(MOD_ROUTING, capacity=[0.25, 0.75]))
    assert spec.routed_layers == [1, 3] and spec.capacity == [0.25, 0.75]
