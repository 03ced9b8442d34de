"""The on-policy probe's pieces (experiments/probes/onpolicy_finetune.py): the continuations it distils on are what
the deployed student writes (window top-k), decoded with caches exactly as a cache-free greedy loop decodes them, and
its targets cover the continuation and nothing else."""

import torch

from experiments.probes.onpolicy_finetune import continuation_labels, greedy_continuations, window_topk_students
from torchtune_dtf.modules.routing_context import RoutingContext

from conftest import VOCAB, build_tiny

IGNORE = -100
WINDOW = 5


def _greedy_without_cache(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    tokens = prompts
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(tokens, routing=RoutingContext(mode="student"))
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def test_continuations_are_the_deployed_window_topk_students_and_the_rule_comes_back():
    # Trained with a threshold student (here one that runs almost nothing), deployed with window top-k at γ 0.5.
    model = build_tiny("stt", student_routing_mode="threshold", student_threshold=0.99, student_window=None).train()
    deployed = build_tiny("stt", student_routing_mode="window_topk", student_threshold=None, student_window=WINDOW)
    prompts = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    model.reset_routing_counters()
    with window_topk_students(model, WINDOW):
        written = greedy_continuations(model, prompts, 12)
    assert written.shape == (3, 21) and torch.equal(written[:, :9], prompts)
    assert torch.equal(written, _greedy_without_cache(deployed, prompts, 12))
    # The block ran the window top-k rule (about γ of the tokens), not the threshold's (almost none).
    assert all(0.3 < f < 0.7 for f in model.executed_fractions().values())
    model.reset_routing_counters()
    greedy_continuations(model, prompts, 12)
    assert all(f < 0.1 for f in model.executed_fractions().values())
    routed = [m for m in model.modules() if hasattr(m, "student_routing_mode")]
    assert routed and all(m.student_routing_mode == "threshold" and m.student_window is None for m in routed)
    assert all(m.attn.kv_cache is None for m in model.layers)  # caches removed: training forwards work again


def test_greedy_continuations_restore_training_mode_and_chunked_output():
    model = build_tiny("dense").train()
    model.set_num_output_chunks(2)  # as torchtune's chunked loss sets it for training
    greedy_continuations(model, torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1)), 3)
    assert model.training and model.num_output_chunks == 2


def test_targets_are_the_continuation_only():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]])
    labels = continuation_labels(tokens, prompt_tokens=3, ignore_index=IGNORE)
    # positions 2, 3, 4 predict tokens 3, 4, 5 (the continuation); 0, 1 predict prompt tokens; 5 has no next token
    assert labels.tolist() == [[IGNORE, IGNORE, 8, 9, 10, IGNORE], [IGNORE, IGNORE, 4, 5, 6, IGNORE]]
