"""What the routed attention's chunking saves: one routed layer's prefill, chunked against one call (issue 47 §2).

    python -m benchmarks.attention_work                     # Qwen2.5-0.5B shape, b1 × 1024, γ = 0.5, 2 threads
    python -m benchmarks.attention_work --size tiny --quick # smoke run

A routed layer whose skipped tokens keep writing K/V (``skipped_tokens_write_kv``) has k selected queries over
all T keys. Attending through the explicit mask in one call computes the whole k × T rectangle; the layer cuts the
queries into chunks that each attend over the keys up to their last query (``routed_block.query_chunks``), in
eager mode exactly (one host read) and compiled with bounds that hold for any selection. This times, in
interleaved rounds, eager and compiled (inductor, per layer): the dense layer, the K/V-kept routed layer chunked
and as one call (``_MAX_QUERY_CHUNKS = 1``, the rectangle), and the selected-only routed layer (causal kernel over
the gathered tokens). Per-sequence top-k student (exactly ⌊γ·T⌋ tokens). Ratios are per-round medians against
the dense layer in the same mode; beside them the closed-form FLOP ratio of the layer, which counts attention as
rectangles on both sides (see ``closed_form.py``). Results: ``benchmarks/results/attention_work/results_<T>.*``.
"""

import argparse
import dataclasses
import json
import platform
import sys
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch
from torchtune.modules import TransformerSelfAttentionLayer

from torchtune_dtf import closed_form as cf
from benchmarks.common import (REPO, config_routing, interleaved, paired_ratio, results_dir, set_threads,
                               subnormals_flushed)
from torchtune_dtf.models import qwen2_5
from torchtune_dtf.models.qwen2_5 import QWEN2_5_SHAPES
from torchtune_dtf.modules import RoutingContext
from torchtune_dtf.modules import routed_block


@contextmanager
def one_attention_call():
    """The routed attention as one call over every key through the mask (the k × T rectangle)."""
    saved = routed_block._MAX_QUERY_CHUNKS
    routed_block._MAX_QUERY_CHUNKS = 1
    try:
        yield
    finally:
        routed_block._MAX_QUERY_CHUNKS = saved


def build_layer(size: str, write_kv: bool, gamma: float, seed: int = 0) -> torch.nn.Module:
    """Layer 1 (routed) of a two-layer model of the shape, top-k student at ``gamma``."""
    architecture = dict(QWEN2_5_SHAPES[size], num_layers=2)
    if size == "tiny":
        architecture.update(vocab_size=512, max_seq_len=256)
    routing = config_routing("stt")
    routing.update(routed_layers=[1], capacity=gamma, skipped_tokens_write_kv=write_kv, skip_update="none",
                   student_routing_mode="topk", student_threshold=None, allow_noncausal_student_topk=True,
                   always_run_first_token=False, dropped_layers=[])
    torch.manual_seed(seed)
    return qwen2_5.routed_qwen2("stt", **architecture, **routing).eval().layers[1]


def layer_flop_ratio(size: str, write_kv: bool, gamma: float, seq_len: int) -> float:
    """Closed-form FLOPs of the routed layer's student forward / the dense layer's (both with rectangles):
    ``closed_form.forward_flops`` of the two-layer model without its LM head, less its dense layer 0."""
    shape = dataclasses.replace(cf.model_shape(size), num_layers=2)
    routing = cf.routing_shape("stt", 2, shape.embed_dim, dict(config_routing("stt"), routed_layers=[1], capacity=gamma,
                                                               skipped_tokens_write_kv=write_kv, skip_update="none",
                                                               dropped_layers=[]))

    def layers(routing_shape) -> int:
        flops = cf.forward_flops(shape, routing_shape, seq_len)
        return flops["total"] - flops["lm_head"]

    dense_layer = layers(cf.RoutingShape.dense()) / 2
    return (layers(routing) - dense_layer) / dense_layer


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0_5b", choices=["0_5b", "tiny"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--quick", action="store_true", help="T = 256, two rounds")
    parser.add_argument("--out", default=None, help="default benchmarks/results/attention_work")
    parser.add_argument("--overwrite", action="store_true", help="replace the results an existing --out holds")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.rounds = 256, 2
    out = None
    if not args.quick or args.out:  # a quick run without --out writes nothing
        out = results_dir(args.out, REPO / "benchmarks" / "results" / "attention_work", overwrite=args.overwrite,
                          names=[f"results_{args.seq_len}.json"])
    set_threads(args.threads)
    torch.manual_seed(0)
    kept, selected = build_layer(args.size, True, args.gamma), build_layer(args.size, False, args.gamma)
    selected.load_state_dict(kept.state_dict())
    x = torch.randn(1, args.seq_len, kept.attn.embed_dim)
    rows = {}
    with subnormals_flushed(True), torch.inference_mode():
        for mode in args.modes:
            if mode == "compiled":
                for layer in (kept, selected):
                    layer.compile(backend="inductor", fullgraph=True)
            student = RoutingContext(mode="student")

            def rectangle():
                with one_attention_call():
                    kept(x, routing=student)

            fns = {
                "dense": lambda: TransformerSelfAttentionLayer.forward(kept, x),
                "kv_kept_chunked": lambda: kept(x, routing=student),
                "kv_kept_one_call": rectangle,
                "selected_only": lambda: selected(x, routing=student),
            }
            if mode == "compiled":  # the dense forward of the same weights, compiled on its own
                dense_compiled = torch.compile(lambda: TransformerSelfAttentionLayer.forward(kept, x), fullgraph=True)
                fns["dense"] = dense_compiled
            times = interleaved(fns, rounds=args.rounds, warmup=2)
            rows[mode] = {name: {"median_s": sorted(t)[len(t) // 2], "vs_dense": paired_ratio(times, name, "dense")}
                          for name, t in times.items()}
    flops = {"kv_kept": layer_flop_ratio(args.size, True, args.gamma, args.seq_len),
             "selected_only": layer_flop_ratio(args.size, False, args.gamma, args.seq_len)}
    result = dict(command="python -m benchmarks.attention_work " + " ".join(argv if argv is not None else sys.argv[1:]),
                  date=str(date.today()), machine=platform.processor() or platform.machine(), torch=torch.__version__,
                  size=args.size, seq_len=args.seq_len, gamma=args.gamma, threads=args.threads, rounds=args.rounds,
                  flop_ratio=flops, times=rows)
    lines = [f"# One routed layer's prefill, b1 × {args.seq_len}, γ = {args.gamma}, {args.size} shape, "
             f"{args.threads} threads, fp32 ({result['date']}, torch {torch.__version__})", "",
             f"`{result['command']}`"
             " (median over rounds of the per-round time / dense layer's, same mode)", "",
             "| layer | " + " | ".join(args.modes) + " | closed-form FLOPs |", "|---|" + "---|" * (len(args.modes) + 1)]
    for name in ("dense", "kv_kept_chunked", "kv_kept_one_call", "selected_only"):
        cells = [f"{rows[m][name]['vs_dense']:.3f} ({rows[m][name]['median_s'] * 1e3:.0f} ms)" for m in args.modes]
        ideal = 1.0 if name == "dense" else flops["selected_only" if name == "selected_only" else "kv_kept"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ideal:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"results_{args.seq_len}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"results_{args.seq_len}.md").write_text(text)
    return result


if __name__ == "__main__":
    main()
