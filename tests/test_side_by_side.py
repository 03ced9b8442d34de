"""torchtune_dtf.evaluation.side_by_side: the measures the quickstart report puts side by side (window losses and their
paired interval, greedy continuations through the KV cache, the degeneration symptoms) and routing_report's windows
spread over a file."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import build_tiny
from torchtune_dtf.evaluation import side_by_side
from torchtune_dtf.evaluation.routing_report import heldout_windows


class _Tokenizer:
    """Characters as token ids; 0 is EOS and the only stop token."""

    stop_tokens = [0]

    def encode(self, text, add_bos=False, add_eos=True):
        return [ord(c) % 500 + 1 for c in text] + ([0] if add_eos else [])

    def decode(self, ids):
        return "".join(chr(96 + i % 26) if i != 10 else "\n" for i in ids)


def _uncached_greedy(model, prompt: torch.Tensor, steps: int) -> list:
    tokens = prompt.clone()
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("variant, overrides", [("dense", {}), ("stt", {"student_routing_mode": "window_topk",
                                                                       "student_threshold": None, "student_window": 8})])
def test_continuation_is_the_greedy_decode_of_the_full_sequence_forward(variant, overrides):
    # Through the (selective) KV cache the decode writes what argmax over the uncached student forward writes:
    # the tokens the report prints are the model's own, not an artifact of the cache or of sampling.
    model = build_tiny(variant, seed=3, **overrides)
    tokenizer = _Tokenizer()
    prompt = "the king rode out"
    (row,) = side_by_side.continuations(model, tokenizer, [prompt], max_new_tokens=12)
    expected = _uncached_greedy(model, torch.tensor([tokenizer.encode(prompt, add_eos=False)]), 12)
    if 0 in expected:  # the decode stops at the stop token
        expected = expected[: expected.index(0)]
    assert row["tokens"] == len(expected) and row["text"] == tokenizer.decode(expected)
    assert row["distinct_2"] == side_by_side.distinct_2(expected)


def test_window_losses_are_the_per_window_cross_entropy():
    model = build_tiny("dense", seed=1)
    windows = torch.randint(1, 500, (5, 20), generator=torch.Generator().manual_seed(0))
    losses = side_by_side.window_losses(model, windows, None, batch_size=2)
    with torch.no_grad():
        expected = torch.stack([F.cross_entropy(model(w[None])[0, :-1], w[1:]) for w in windows])
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)


def test_paired_bootstrap_resamples_windows_for_both_models():
    gen = torch.Generator().manual_seed(0)
    dense = 4.0 + torch.rand(64, generator=gen)  # window difficulty varies a lot ...
    routed = dense + 0.3 + 0.01 * torch.randn(64, generator=gen)  # ... the paired gap hardly
    low, high = side_by_side.paired_bootstrap(routed, dense, resamples=2000, seed=0)
    assert low < float((routed - dense).mean()) < high and high - low < 0.01  # pairing removes window difficulty
    assert side_by_side.paired_bootstrap(routed, dense, resamples=2000, seed=0) == (low, high)  # seeded
    flat = torch.full((8,), 0.2)
    assert side_by_side.paired_bootstrap(flat + 1, torch.ones(8), resamples=100, seed=0) == pytest.approx((0.2, 0.2))
    with pytest.raises(ValueError, match="two vectors of one length"):
        side_by_side.paired_bootstrap(dense, dense[:3], resamples=10, seed=0)


def test_degeneration_symptoms():
    assert side_by_side.newline_share("\n\n\n\n") == 1.0 and side_by_side.newline_share("ab\ncd") == 0.2
    assert side_by_side.newline_share("") == 0.0
    assert side_by_side.distinct_2([1, 2, 3, 4]) == 1.0
    assert side_by_side.distinct_2([7, 7, 7, 7, 7]) == 0.25  # one bigram, four times
    assert side_by_side.distinct_2([1, 2, 1, 2, 1]) == 0.5 and side_by_side.distinct_2([5]) == 0.0


def test_spread_windows_reach_the_end_of_the_file(tmp_path):
    path = tmp_path / "test.jsonl"
    docs = [chr(97 + i) * 30 for i in range(10)]  # ten documents, each one letter
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = _Tokenizer()
    windows = heldout_windows(tokenizer, path, seq_len=8, num_windows=5, spread=True)
    assert windows.shape == (5, 8)
    letters = [tokenizer.encode(chr(97 + i), add_eos=False)[0] for i in range(10)]
    starts = [int(w[0]) for w in windows]
    assert starts[0] == letters[0] and starts[-1] in letters[7:]  # the last window lies in the file's last documents
    with pytest.raises(ValueError, match="fewer than 50 windows"):
        heldout_windows(tokenizer, path, seq_len=8, num_windows=50, spread=True)
