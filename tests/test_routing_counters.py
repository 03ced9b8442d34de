"""torchtune_dtf.modules.{layers, decoder} (student routing counters): what each routed layer executed, readable
after callers that cannot pass a ``RoutingContext`` (torchtune's ``generate``, the eleuther_eval wrapper).

The reference everywhere is the ``selected_mask [b, s]`` the same forwards record in a RoutingContext."""

import math

import pytest
import torch
from torchtune import training
from torchtune.generation import generate
from torchtune.modules.common_utils import local_kv_cache

from tests.conftest import ROUTED_VARIANTS, VOCAB, build_tiny, routing_kwargs, tiny_architecture
from tests.test_selective_cache import MAX_LEN, causal_masks, decode_incrementally, record_routed_calls
from torchtune_dtf.models import qwen2_5
from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext

COUNTED_VARIANTS = ("random",) + ROUTED_VARIANTS


def counts(model):
    return model.routing_token_counts()


def mask_counts(masks):
    """``{layer: (executed, seen)}`` from per-layer ``[b, s]`` masks."""
    return {idx: (int(mask.sum()), mask.numel()) for idx, mask in masks.items()}


def assert_nontrivial(executed_seen):
    for idx, (executed, seen) in executed_seen.items():
        assert 0 < executed < seen, f"routed layer {idx} ran every token (or none): proves nothing"


@pytest.mark.parametrize("variant", COUNTED_VARIANTS)
def test_counters_equal_the_selected_masks_without_cache(variant, tokens):
    model = build_tiny(variant)
    assert counts(model) == {1: (0, 0), 3: (0, 0)}
    expected = {}
    for chunk in (tokens, tokens[:2, :10]):  # two forwards of different shapes accumulate
        ctx = RoutingContext(mode="student")
        model(chunk, routing=ctx)
        for idx, (executed, seen) in mask_counts({i: r.selected_mask for i, r in ctx.layers.items()}).items():
            before = expected.get(idx, (0, 0))
            expected[idx] = (before[0] + executed, before[1] + seen)
    assert counts(model) == expected
    assert expected[1][1] == tokens.numel() + 20
    assert_nontrivial(expected)
    fractions = model.executed_fractions()
    assert fractions == {idx: executed / seen for idx, (executed, seen) in expected.items()}


@pytest.mark.parametrize("variant", COUNTED_VARIANTS)
def test_counters_count_each_decoded_token_once_and_equal_the_cache_fill(variant, tokens):
    model = build_tiny(variant)
    model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    _, executed = decode_incrementally(model, tokens, prompt_len=9)  # prefill of 9, then 15 one-token steps
    expected = mask_counts(executed)
    # Prefill tokens plus one per decode step per row: every token of the layout, once.
    assert all(seen == tokens.numel() for _, seen in expected.values())
    assert counts(model) == expected
    assert_nontrivial(expected)
    for layer in model.routed_layers():  # the selective cache holds exactly the executed tokens
        assert int(layer.attn.kv_cache.fill.sum()) == expected[layer.layer_idx][0]


def test_counters_after_torchtune_generate_equal_its_routing_decisions():
    # What routed_generate.py reads: torchtune's generate() feeds the prompt, then each generated token
    # but the last, for every row (no stop tokens here, so all rows decode to the end).
    model = build_tiny("stt")
    prompts = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(11))
    new = 8
    _, decisions, handles = record_routed_calls(model)
    with local_kv_cache(model, batch_size=3, device=torch.device("cpu"), dtype=torch.float32, decoder_max_seq_len=9 + new):
        generate(model, prompts, max_generated_tokens=new, pad_id=0, temperature=1.0, top_k=1)
    for handle in handles:
        handle.remove()
    expected = mask_counts({idx: torch.cat(calls, dim=1) for idx, calls in decisions.items()})
    assert all(seen == 3 * (9 + new - 1) for _, seen in expected.values())
    assert counts(model) == expected
    assert_nontrivial(expected)


@pytest.mark.parametrize("variant", ("random", "mod", "stt"))
def test_counting_does_not_change_outputs(variant, tokens, monkeypatch):
    def run(model):
        torch.manual_seed(3)  # the random baseline draws its decisions from the global generator
        full = model(tokens)
        model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
        incremental, _ = decode_incrementally(model, tokens, prompt_len=9)
        model.reset_caches()
        return full, incremental

    counted_full, counted_incremental = run(build_tiny(variant))
    with monkeypatch.context() as patch:
        patch.setattr(RoutedSelfAttentionLayer, "_count_student", lambda self, selected: None)
        uncounted = build_tiny(variant)
        plain_full, plain_incremental = run(uncounted)
        assert counts(uncounted) == {1: (0, 0), 3: (0, 0)}, "the patch did not switch counting off"
    assert torch.equal(counted_full, plain_full)
    assert torch.equal(counted_incremental, plain_incremental)


def test_teacher_and_dense_forwards_are_not_counted(tokens):
    model = build_tiny("stt").train()
    for ctx in (
        RoutingContext(mode="teacher", beta_ce=1.0, beta_cu=1.0),
        RoutingContext(mode="teacher", beta_ce=1.0, beta_cu=1.0, execute="student"),  # scheduled sampling
        RoutingContext(mode="dense"),
    ):
        model(tokens, routing=ctx)
        assert counts(model) == {1: (0, 0), 3: (0, 0)}, ctx.mode
    ctx = RoutingContext(mode="student")  # a student forward in training (validation) does count
    model(tokens, routing=ctx)
    assert counts(model) == mask_counts({i: r.selected_mask for i, r in ctx.layers.items()})


def test_counters_stay_out_of_checkpoints_keep_int64_and_reset_to_zero(tokens):
    model = build_tiny("mod")
    model(tokens)
    assert counts(model)[1][1] == tokens.numel()
    # Non-persistent buffers: they move with the model but never enter a checkpoint.
    buffers = {name for name, _ in model.named_buffers()}
    assert {"layers.1.routed_tokens_seen", "layers.1.routed_tokens_executed"} <= buffers
    assert not any("routed_tokens" in key for key in model.state_dict())
    fresh = build_tiny("mod")
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert counts(fresh) == {1: (0, 0), 3: (0, 0)}
    before = counts(model)
    model.to(torch.float64)  # integer counters keep their dtype and values
    assert model.layers[1].routed_tokens_seen.dtype == torch.int64 and counts(model) == before
    model.to(torch.float32)

    model.reset_routing_counters()
    assert counts(model) == {1: (0, 0), 3: (0, 0)}
    assert all(math.isnan(f) for f in model.executed_fractions().values())
    ctx = RoutingContext(mode="student")
    model(tokens[:, :7], routing=ctx)
    assert counts(model) == mask_counts({i: r.selected_mask for i, r in ctx.layers.items()})

    # On device, without a host round trip: the counters are the layer's own 0-dim int64 tensors.
    executed, seen = model.routing_counters()[1]
    assert executed is model.layers[1].routed_tokens_executed and seen.shape == () and seen.dtype == torch.int64


def test_models_built_on_meta_have_no_counter_to_materialise(tokens):
    # FSDP (routed_finetune) and the benchmarks build on meta and then materialise only the parameters and
    # RoPE buffers; counters created on the first counted forward leave nothing on meta.
    reference = build_tiny("stt")
    with torch.device("meta"):
        model = qwen2_5.routed_qwen2("stt", **tiny_architecture(), **routing_kwargs("stt"))
    model.load_state_dict(reference.state_dict(), strict=True, assign=True)
    with torch.device("cpu"):
        for module in model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()
    training.validate_no_params_on_meta_device(model)
    ctx = RoutingContext(mode="student")
    model.eval()(tokens, routing=ctx)
    assert counts(model) == mask_counts({i: r.selected_mask for i, r in ctx.layers.items()})


def test_counters_survive_inference_mode_then_grad_mode(tokens):
    # torchtune's generate runs under inference_mode; lm-eval's loglikelihood passes do not. Counters first
    # created inside inference_mode must still accept in-place updates outside it.
    model = build_tiny("stt")
    with torch.inference_mode():
        model(tokens)
    with torch.no_grad():
        model(tokens)
    model(tokens)
    assert all(seen == 3 * tokens.numel() for _, seen in counts(model).values())


def test_models_without_routed_layers_report_nothing(tokens):
    for variant in ("dense", "layerdrop"):
        model = build_tiny(variant)
        model(tokens)
        assert model.routed_layers() == [] and model.executed_fractions() == {} and model.routing_counters() == {}
        model.reset_routing_counters()
