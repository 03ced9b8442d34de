"""Attention of selected queries over every earlier key, three ways, timed alone (issue 47 §2).

    python -m benchmarks.selected_attention                 # SmolLM2 heads, 512 of 1,024 queries, 2 threads
    python -m benchmarks.selected_attention --quick         # smoke run

A routed layer whose skipped tokens keep writing K/V has k selected queries (ascending positions ``p``) over all T
keys, query i seeing keys ``<= p_i``. The layer cuts the queries into chunks, each attending over a prefix of the
keys (``routed_block.query_chunks``); eager code reads the exact prefix from the device, compiled code takes a bound
that holds for every selection (the i-th of k ascending positions is at most T − k + i). This times, in interleaved
rounds: the chunks with the static bounds (compiled, as a compiled layer runs them), the chunks with exact bounds
(eager, as an eager layer runs them), ``flex_attention`` with a block mask built from the positions on the device
(compiled; exact and without a host read), the chunks with exact bounds read inside the graph as unbacked sizes
(compiled with ``capture_scalar_outputs``: exact, one graph, no break), the routed layer's own operator
(``routed_block.selected_attention_by_chunks``, compiled: exact bounds read inside an operator the graph does not
trace, on the CPU), and dense causal attention over all T queries (compiled), the cost the routed layer's attention
replaces.
"""

import argparse
import statistics
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from benchmarks.common import interleaved, set_threads
from torchtune_dtf.modules.routed_block import query_chunks, selected_attention_by_chunks


def _chunks(num_queries: int) -> List[range]:
    """The routed layer's own chunks of ``num_queries`` time-ordered queries."""
    return [range(start, end) for start, end in query_chunks(num_queries)]


def chunked(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
            bounds: List[int]) -> torch.Tensor:
    """``q [1, h, k, d]`` over ``key``/``value [1, h_kv, T, d]``, chunk j over the first ``bounds[j]`` keys."""
    outputs = []
    for chunk, num_keys in zip(_chunks(q.shape[2]), bounds):
        mask = torch.arange(num_keys)[None, :] <= positions[chunk.start:chunk.stop, None]
        outputs.append(F.scaled_dot_product_attention(
            q[:, :, chunk.start:chunk.stop], key[:, :, :num_keys], value[:, :, :num_keys],
            attn_mask=mask[None, None], enable_gqa=True))
    return torch.cat(outputs, dim=2)


def static_bounds(num_queries: int, num_keys: int) -> List[int]:
    """Per chunk, the keys any selection of ``num_queries`` ascending positions among ``num_keys`` may need."""
    return [num_keys - num_queries + chunk.stop for chunk in _chunks(num_queries)]


def exact_bounds(positions: torch.Tensor) -> List[int]:
    """Per chunk, one past its last query's position (a host read)."""
    return [int(positions[chunk.stop - 1]) + 1 for chunk in _chunks(positions.shape[0])]


def chunked_read_in_graph(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
    """The chunks with exact bounds computed from ``positions`` and read as Python ints: eager, a host read;
    compiled with ``capture_scalar_outputs``, unbacked sizes inside one graph (the checks bound them for the
    compiler)."""
    num_keys = key.shape[2]
    ends = torch.tensor([chunk.stop - 1 for chunk in _chunks(q.shape[2])], device=positions.device)
    bounds = (positions.index_select(0, ends) + 1).tolist()
    for bound in bounds:
        torch._check(bound >= 1)
        torch._check(bound <= num_keys)
    return chunked(q, key, value, positions, bounds)


def layer_operator(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                   static: List[int]) -> torch.Tensor:
    """The routed layer's operator over the same chunks, given what the layer's graph gives it: the additive mask
    over all keys and each chunk's exact number of keys (on the device; the CPU kernel reads it)."""
    bias = torch.zeros(q.shape[2], key.shape[2]).masked_fill(torch.arange(key.shape[2])[None, :] > positions[:, None],
                                                             float("-inf"))
    ends = [chunk.stop for chunk in _chunks(q.shape[2])]
    bounds = positions.index_select(0, torch.tensor([end - 1 for end in ends])) + 1
    return selected_attention_by_chunks(q, key, value, bias[None, None], bounds, ends, static, True)


def flex(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The same attention through ``flex_attention``: blocks wholly above a query block's staircase are skipped."""
    def mask_mod(batch, head, query_index, key_index):
        return key_index <= positions[query_index]

    block_mask = create_block_mask(mask_mod, None, None, q.shape[2], key.shape[2], device=str(q.device),
                                   BLOCK_SIZE=64)
    return flex_attention(q, key, value, block_mask=block_mask, enable_gqa=True)


def inputs(num_keys: int, num_queries: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    positions = torch.sort(torch.randperm(num_keys, generator=generator)[:num_queries]).values
    q = torch.randn(1, heads, num_queries, head_dim, generator=generator)
    key = torch.randn(1, kv_heads, num_keys, head_dim, generator=generator)
    value = torch.randn(1, kv_heads, num_keys, head_dim, generator=generator)
    return q, key, value, positions


def main(argv=None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10, help="calls per timing")
    parser.add_argument("--quick", action="store_true", help="256 keys, 128 queries, 2 rounds of 2 calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.queries, args.rounds, args.calls = 256, 128, 2, 2
    set_threads(args.threads)
    q, key, value, positions = inputs(args.keys, args.queries, args.heads, args.kv_heads, args.head_dim)
    dense_q = torch.randn(1, args.heads, args.keys, args.head_dim)
    static, exact = static_bounds(args.queries, args.keys), exact_bounds(positions)
    compiled_chunks = torch.compile(chunked, fullgraph=True)
    compiled_flex = torch.compile(flex, fullgraph=True)
    compiled_read = torch.compile(chunked_read_in_graph, fullgraph=True)
    compiled_operator = torch.compile(layer_operator, fullgraph=True)
    compiled_dense = torch.compile(
        lambda: F.scaled_dot_product_attention(dense_q, key, value, is_causal=True, enable_gqa=True), fullgraph=True)
    fns: Dict[str, Callable[[], torch.Tensor]] = {
        "chunks, static bounds (compiled)": lambda: compiled_chunks(q, key, value, positions, static),
        "chunks, exact bounds (eager)": lambda: chunked(q, key, value, positions, exact),
        "flex_attention, block mask (compiled)": lambda: compiled_flex(q, key, value, positions),
        "chunks, exact bounds read in the graph (compiled)": lambda: compiled_read(q, key, value, positions),
        "the layer's operator, exact bounds read inside it (compiled)":
            lambda: compiled_operator(q, key, value, positions, static),
        f"dense causal, all {args.keys} queries (compiled)": compiled_dense,
    }
    # Only the unbacked-size read needs the flag; dynamo reads it when it traces (the first call, below).
    with torch.inference_mode(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        reference = chunked(q, key, value, positions, exact)
        for name in list(fns)[:5]:
            error = (fns[name]() - reference).abs().max().item()
            if error > 1e-4:
                raise AssertionError(f"{name} differs from the exact chunks by {error:.2e}")
        def repeated(fn):
            return lambda: [fn() for _ in range(args.calls)]

        times = interleaved({name: repeated(fn) for name, fn in fns.items()}, rounds=args.rounds, warmup=1)
    medians = {name: statistics.median(values) / args.calls * 1e3 for name, values in times.items()}
    print(f"{args.queries} selected queries over {args.keys} keys, {args.heads}/{args.kv_heads} heads of "
          f"{args.head_dim}, {args.threads} threads, median of {args.rounds} rounds × {args.calls} calls:")
    for name, value in medians.items():
        print(f"  {name:48s} {value:8.2f} ms")
    return medians


if __name__ == "__main__":
    main()
