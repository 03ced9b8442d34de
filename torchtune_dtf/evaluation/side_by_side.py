"""What a user compares between a dense and a routed model: loss per window with an interval, measured speed, and
what greedy decoding writes.

- :func:`window_losses` and :func:`paired_bootstrap`: the per-window loss of each model and a bootstrap interval of
  the mean difference, resampling windows (both models scored on the same resampled windows), so the interval
  covers text sampling, which seeds do not.
- :func:`prefill_tokens_per_s` and :func:`generate_tokens_per_s`: wall-clock throughput of the deployed forward,
  the models timed interleaved (A B, B A, ...) on the same machine in the same process, medians reported.
- :func:`continuations`, :func:`newline_share`, :func:`distinct_2`: greedy continuations of prompts (torchtune's
  ``generate`` with the model's KV cache: the selective cache for a routed model) and two symptoms of degenerate
  text: the share of generated characters that are newlines, and the share of distinct token bigrams.
"""

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torchtune import generation
from torchtune.modules.common_utils import delete_kv_caches

from torchtune_dtf.modules.routing_context import RoutingContext


@torch.no_grad()
def window_losses(model, windows: torch.Tensor, routing: Optional[Callable[[], RoutingContext]], batch_size: int) -> torch.Tensor:
    """``[num_windows]`` mean next-token loss of each window. ``routing`` makes a fresh context per batch (``None``:
    a dense model, called without one)."""
    losses = []
    for batch in windows.split(batch_size):
        logits = model(batch) if routing is None else model(batch, routing=routing())
        losses.append(next_token_losses(logits, batch))
    return torch.cat(losses)


def next_token_losses(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """``[b]`` mean next-token cross-entropy of each row: ``logits [b, s, vocab]`` of ``batch [b, s]`` tokens."""
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), batch[:, 1:], reduction="none")
    return per_token.mean(dim=1)


def paired_bootstrap(a: torch.Tensor, b: torch.Tensor, *, resamples: int, seed: int, level: float = 0.95) -> Tuple[float, float]:
    """Percentile interval of ``mean(a − b)`` over windows resampled with replacement, the same windows for both."""
    if a.shape != b.shape or a.dim() != 1:
        raise ValueError(f"paired losses must be two vectors of one length, got {tuple(a.shape)} and {tuple(b.shape)}")
    diff = (a - b).double()
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(diff), (resamples, len(diff)), generator=gen)
    means = diff[picks].mean(dim=1)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=means.dtype)).tolist()
    return low, high


def _interleaved(fns: Dict[str, Callable[[], object]], rounds: int) -> Dict[str, List[float]]:
    """Seconds per call of each function, one untimed warm-up call each, then ``rounds`` rounds in rotating order."""
    for fn in fns.values():
        fn()
    names, times = list(fns), {name: [] for name in fns}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _median(values: Sequence[float]) -> float:
    return float(torch.tensor(values).median())


@torch.inference_mode()
def prefill_tokens_per_s(models: Dict[str, torch.nn.Module], tokens: torch.Tensor, rounds: int) -> Dict[str, float]:
    """Tokens per second of one forward over ``tokens [b, T]`` (no cache), per model, medians of ``rounds``."""
    times = _interleaved({name: (lambda m=model: m(tokens)) for name, model in models.items()}, rounds)
    return {name: tokens.numel() / _median(t) for name, t in times.items()}


def _greedy(model, prompt: torch.Tensor, max_new_tokens: int, stop_tokens: Optional[List[int]]) -> torch.Tensor:
    """``[1, prompt + generated]`` tokens of a greedy decode with KV caches sized to the request, removed after it
    (the model is left as it came: a full-sequence forward works again)."""
    if model.caches_are_setup():
        raise ValueError("the model already has KV caches set up; generate with a model that has none")
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=prompt.shape[1] + max_new_tokens)
    try:
        out, _ = generation.generate(
            model, prompt, max_generated_tokens=max_new_tokens, temperature=1.0, top_k=1, stop_tokens=stop_tokens)
    finally:
        delete_kv_caches(model)
    return out


@torch.inference_mode()
def generate_tokens_per_s(
    models: Dict[str, torch.nn.Module], prompt: torch.Tensor, max_new_tokens: int, rounds: int
) -> Dict[str, float]:
    """Generated tokens per second of a greedy ``generate`` (prompt prefill + ``max_new_tokens`` decode steps, no stop
    token, so every model writes the same number), per model, medians of ``rounds``."""
    times = _interleaved({name: (lambda m=model: _greedy(m, prompt, max_new_tokens, None)) for name, model in models.items()}, rounds)
    return {name: max_new_tokens / _median(t) for name, t in times.items()}


@torch.inference_mode()
def continuations(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> List[Dict]:
    """Greedy continuation of each prompt (stopping at the tokenizer's stop tokens), with its symptoms."""
    rows = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_bos=False, add_eos=False)])
        out = _greedy(model, ids, max_new_tokens, list(tokenizer.stop_tokens))
        generated = [t for t in out[0, ids.shape[1]:].tolist() if t not in tokenizer.stop_tokens]
        text = tokenizer.decode(generated)
        rows.append({"prompt": prompt, "text": text, "tokens": len(generated),
                     "newline_share": newline_share(text), "distinct_2": distinct_2(generated)})
    return rows


def newline_share(text: str) -> float:
    """Share of the characters that are newlines (0 for empty text); a collapsed model writes mostly newlines."""
    return text.count("\n") / len(text) if text else 0.0


def distinct_2(token_ids: Sequence[int]) -> float:
    """Distinct token bigrams over all bigrams (1 = no bigram repeats; a loop drives it to 0); 0 for < 2 tokens."""
    bigrams = list(zip(token_ids, token_ids[1:]))
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0
