"""The routed decode step at batch 1 stays lean: what each layer kind launches (aten operators, counted by the
profiler on the tiny model in the study's recommended shape), the router's weights derived once per generation
and never stale, and the one-token shortcuts (window rule, cache writes) equal to the general code."""

import pytest
import torch
from torchtune.modules.common_utils import delete_kv_caches

from benchmarks.decode_ops import Decode, profile_steps
from tests.conftest import VOCAB, build_tiny
from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext, SelectiveKVCache
from torchtune_dtf.modules.selection import window_topk_mask

#: The quickstart's recommended student on the tiny shape: a dropped layer, routed layers (1, 3) whose skipped tokens
#: keep writing K/V, a skip bias, the first token always run, the deployed window top-k student.
RECOMMENDED = dict(skipped_tokens_write_kv=True, skip_update="bias", always_run_first_token=True, dropped_layers=[2],
                   student_routing_mode="window_topk", student_threshold=None, student_window=4)
PROMPT = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))


def operators(model, steps=12):
    return profile_steps(model, PROMPT, steps, warmup=2)


def test_routed_decode_step_launches_at_most_1_2x_the_operators_of_dense():
    # Issue 47's target for a decode step. Each routed layer also stays within a bound of a plain layer's count:
    # at the time of writing a routed layer that ran its token launched 1.84x a plain layer's operators (2.46x
    # before the one-token shortcuts) and one that skipped it 1.17x (1.60x), the quickstart shape alike.
    dense = operators(build_tiny("dense"))
    routed = operators(build_tiny("stt", **RECOMMENDED))
    assert routed["ops_per_step"] <= 1.2 * dense["ops_per_step"]
    plain = dense["ops_per_layer_call"]["plain"]
    calls = routed["ops_per_layer_call"]
    assert calls["plain"] == plain
    assert {"routed (ran)", "routed (skipped)"} <= set(calls), "both decisions must occur for the bounds to mean much"
    assert calls["routed (ran)"] <= 2.0 * plain
    assert calls["routed (skipped)"] <= 1.3 * plain


@pytest.mark.parametrize("skip_update, launched", [("bias", 1), ("none", 0)])
def test_dropped_layer_launches_nothing_but_its_skip_bias(skip_update, launched):
    # No norm, no cache write, no conversion: the skip bias's add, or nothing.
    model = build_tiny("stt", **dict(RECOMMENDED, skip_update=skip_update))
    assert operators(model, steps=3)["ops_per_layer_call"]["dropped"] == launched


@torch.inference_mode()
def decode_selections(model, steps=10):
    """Per routed layer, the selected mask ``[1, steps]`` of ``steps`` decode steps after the prompt, and the tokens."""
    decode = Decode(model, PROMPT, steps)
    decode.start()
    masks, tokens = {}, []
    for _ in range(steps):
        ctx = RoutingContext(mode="student")
        pos = decode.position
        mask, input_pos = decode.masks[:, pos, None, :], decode.input_pos[:, pos]
        logits = model(decode.token, mask=mask, input_pos=input_pos, routing=ctx)
        decode.token, decode.position = logits[:, -1:].argmax(-1), pos + 1
        tokens.append(decode.token)
        for i, record in ctx.layers.items():
            masks.setdefault(i, []).append(record.selected_mask)
    return {i: torch.cat(m, dim=1) for i, m in masks.items()}, torch.cat(tokens, dim=1)


def test_a_generation_after_a_weight_change_decodes_with_the_new_weights():
    # Nothing derived from the weights outlives a generation: the second decodes with the new weights, as a
    # fresh model does.
    model = build_tiny("stt", **RECOMMENDED)
    before = decode_selections(model)
    delete_kv_caches(model)
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer, RoutedSelfAttentionLayer):
                layer.causal_router.hidden.weight.mul_(-3.0)
                layer.causal_router.norm.scale.add_(0.5)
    after = decode_selections(model)
    delete_kv_caches(model)
    fresh = build_tiny("stt", **RECOMMENDED)
    fresh.load_state_dict(model.state_dict())
    expected = decode_selections(fresh)
    assert any(not torch.equal(before[0][i], after[0][i]) for i in after[0]), "the change must change decisions"
    assert all(torch.equal(after[0][i], expected[0][i]) for i in expected[0])
    assert torch.equal(after[1], expected[1])


def test_window_rule_one_token_at_a_time_equals_the_whole_sequence():
    # Scores on a coarse grid tie often; rows hold packed sequences (a start mid-row) and the carried window
    # begins partly invalid, as after left padding.
    gen = torch.Generator().manual_seed(0)
    batch, seq_len, width, capacity = 3, 17, 5, 0.4
    scores = torch.randint(0, 4, (batch, seq_len), generator=gen).float()
    starts = torch.rand(batch, seq_len, generator=gen) < 0.15
    recent = torch.randint(0, 4, (batch, width - 1), generator=gen).float()
    recent_valid = torch.rand(batch, width - 1, generator=gen) < 0.6
    whole, whole_recent, whole_valid = window_topk_mask(scores, starts, capacity, recent, recent_valid)
    steps = []
    for t in range(seq_len):
        one = slice(t, t + 1)
        mask, recent, recent_valid = window_topk_mask(scores[:, one], starts[:, one], capacity, recent, recent_valid)
        steps.append(mask)
    assert torch.equal(torch.cat(steps, dim=1), whole)
    assert torch.equal(recent, whole_recent) and torch.equal(recent_valid, whole_valid)


@pytest.mark.parametrize("num_new", [1, 3])
def test_cache_write_for_every_row_equals_the_indexed_write(num_new):
    # append(None, ...) (every row, no padding: one scatter per buffer) against the same rows named explicitly.
    gen = torch.Generator().manual_seed(num_new)
    caches = [SelectiveKVCache(batch_size=2, num_kv_heads=2, head_dim=3, max_seq_len=12, embed_dim=4,
                               dtype=torch.float32, initial_entries=4) for _ in range(2)]
    for step in range(3):
        k, v = torch.randn(2, 2, num_new, 3, generator=gen), torch.randn(2, 2, num_new, 3, generator=gen)
        slots = torch.arange(num_new).expand(2, num_new) + step * num_new
        written = [caches[0].append(None, k, v, slots), caches[1].append(torch.arange(2), k, v, slots)]
        assert torch.equal(*written)
    for (name, a), (_, b) in zip(caches[0].named_buffers(), caches[1].named_buffers()):
        assert torch.equal(a, b), name
