"""Wall time of each decoder layer's call in batch-1 decode steps, by kind: plain layer, routed layer that runs its
token, routed layer that skips it, dropped layer (issue 47: what a routed decode step pays beyond its work).

    python -m benchmarks.decode_layer_calls --shape 0_5b --model mod_papers_50             # compiled per layer
    python -m benchmarks.decode_layer_calls --shape 0_5b --model mod_papers_50 --eager
    python -m benchmarks.decode_layer_calls --shape tiny --model stt_papers_50 --steps 4   # smoke run

The model and its decode are ``benchmarks.compiled``'s decode b1 workload (random weights, threshold student
calibrated to γ, static caches and ``compile_layers`` when compiled, a prompt of ``--context`` random tokens, then
``--steps`` steps reading a fixed random token stream). Each layer is wrapped in a module that reads the clock
around the layer's call, outside any compiled region, so a compiled layer's time includes what its call costs
besides its graphs: dynamo's cache lookups (guards), the eager code between graphs and the host read of a
threshold layer. Whether a routed layer ran its token is read from its routing counter after the call (one host
read per routed layer and step, outside the timed interval). The last of ``--rounds`` rounds is reported.
"""

import argparse
import statistics
import time
from typing import Dict, List, Optional

import torch

from benchmarks.common import calibrate_student_threshold, median, set_threads, subnormals_flushed
from benchmarks.compiled import Decoder, build_models, plan_models
from torchtune_dtf.modules import RoutedSelfAttentionLayer
from torchtune_dtf.modules.layers import DroppedLayer
from torchtune_dtf.training.compile import compile_layers


class ClockedLayer(torch.nn.Module):
    """``layer`` whose calls are timed into ``times[kind]`` (µs); every other attribute is the layer's."""

    def __init__(self, layer: torch.nn.Module, times: Dict[str, List[float]]) -> None:
        super().__init__()
        self.layer, self.times = layer, times

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # setup_caches, caches_are_setup, ...: the wrapped layer's
            return getattr(super().__getattr__("layer"), name)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        routed = isinstance(self.layer, RoutedSelfAttentionLayer)
        before = int(self.layer.routing_counts()[0]) if routed else 0
        start = time.perf_counter()
        out = self.layer(*args, **kwargs)
        elapsed = (time.perf_counter() - start) * 1e6
        if routed:
            kind = "routed, ran its token" if int(self.layer.routing_counts()[0]) > before else "routed, skipped it"
        elif isinstance(self.layer, DroppedLayer):
            kind = "dropped layer"
        else:
            kind = "plain layer"
        self.times.setdefault(kind, []).append(elapsed)
        return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0_5b", choices=["smollm2", "0_5b", "tiny"])
    parser.add_argument("--model", default="mod_papers_50", help="a label of benchmarks.compiled's models")
    parser.add_argument("--eager", action="store_true", help="time eager layers (default: compiled per layer)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    set_threads(args.threads)
    sections = plan_models(args.shape)
    if args.model not in sections:
        raise SystemExit(f"unknown --model {args.model!r}; this shape has {sorted(sections)}")
    model = build_models({"dense": sections["dense"], args.model: sections[args.model]}, "threshold",
                         torch.device("cpu"), torch.float32)[args.model]
    vocab = sections["dense"]["vocab_size"]
    routed = [m for m in model.modules() if isinstance(m, RoutedSelfAttentionLayer)]
    if routed:
        calibration = torch.randint(0, vocab, (1, min(256, args.context)), generator=torch.Generator().manual_seed(2))
        calibrate_student_threshold(model, calibration, median([m.capacity for m in routed]))
    if not args.eager:
        model.use_static_kv_caches()
        compile_layers(model)
    times: Dict[str, List[float]] = {}
    for i in range(len(model.layers)):
        model.layers[i] = ClockedLayer(model.layers[i], times)
    prompt = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(1))
    stream = torch.randint(0, vocab, (1, args.steps), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(model, prompt, args.steps, False, torch.float32, stream)
    with subnormals_flushed(True):
        for _ in range(args.rounds):  # the first rounds compile and warm up
            decoder.prepare()
            times.clear()
            start = time.perf_counter()
            decoder()
            step_ms = (time.perf_counter() - start) / args.steps * 1e3
    mode = "eager" if args.eager else "compiled"
    print(f"{args.shape} {args.model}, {mode}, decode b1 at context {args.context}, {args.threads} threads, "
          f"{args.steps} steps: {step_ms:.1f} ms per step")
    summary = {}
    for kind, values in sorted(times.items()):
        summary[kind] = {"calls": len(values), "median_us": statistics.median(values),
                         "ms_per_step": sum(values) / args.steps / 1e3}
        print(f"  {kind}: {len(values)} calls, median {summary[kind]['median_us']:.0f} µs, "
              f"{summary[kind]['ms_per_step']:.2f} ms per step")
    outside = step_ms - sum(s["ms_per_step"] for s in summary.values())
    print(f"  outside the layers (embedding, head, sampling, Python): {outside:.2f} ms per step")
    summary["step_ms"] = {"ms_per_step": step_ms}
    return summary


if __name__ == "__main__":
    main()
