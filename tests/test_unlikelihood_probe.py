"""The unlikelihood probe's penalty (experiments/probes/unlikelihood_finetune.py) against a direct loop over
positions with Python sets, on tiny random logits with repeated and ignored targets."""

import math

import torch

from experiments.probes.unlikelihood_finetune import token_unlikelihood

IGNORE = -100


def _by_loop(logits: torch.Tensor, labels: torch.Tensor) -> float:
    probs = torch.softmax(logits.double(), dim=-1)
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] == IGNORE:
                continue
            context = {int(x) for x in labels[b, :t] if x != IGNORE} - {int(labels[b, t])}
            total -= sum(math.log(1 - float(probs[b, t, c])) for c in context)
            count += 1
    return total / count


def test_matches_a_loop_over_positions_and_distinct_context_tokens():
    torch.manual_seed(0)
    labels = torch.tensor([[3, 1, 3, 3, 2, 1, 0, 3], [4, 4, IGNORE, 2, 4, 2, 1, IGNORE]])
    logits = torch.randn(2, 8, 5) * 2
    expected = _by_loop(logits, labels)
    assert abs(float(token_unlikelihood(logits, labels, IGNORE)) - expected) < 1e-5
    # torchtune's chunked output gives the same value
    assert abs(float(token_unlikelihood(list(logits.chunk(4, dim=1)), labels, IGNORE)) - expected) < 1e-5


def test_penalises_earlier_context_tokens_and_pushes_them_down():
    labels = torch.tensor([[0, 1, 2, 3]])
    logits = torch.zeros(1, 4, 6, requires_grad=True)
    loss = token_unlikelihood(logits, labels, IGNORE)
    loss.backward()
    assert float(loss) > 0  # uniform p gives every earlier token some probability
    # the gradient lowers the logits of earlier tokens at later positions and leaves position 0 alone
    assert torch.all(logits.grad[0, 3, :3] > 0) and torch.all(logits.grad[0, 0] == 0)
