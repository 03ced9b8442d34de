"""Where a routed decode step at batch 1 spends its operators and its time, against dense (issue 48 §3, issue 47).

    python -m benchmarks.decode_ops                                   # quickstart shape, random weights, seed 0
    python -m benchmarks.decode_ops --checkpoint quickstart_work/smollm2_hf --rounds 9
    python -m benchmarks.decode_ops --quick                           # smoke run (fewer steps, no timing)

The models are the quickstart's dense control and its recommended ≈ 0.81 student as deployed
(``configs/quickstart/dense_smollm2.yaml`` and ``eval_recommended_0_81_smollm2.yaml``: 30 layers, 5 dropped whole,
6 routed at γ = 0.5 with K/V kept and a skip bias, window top-k student), built from the configs' model sections
under a fixed seed, or loaded from a checkpoint folder as ``routing_report`` loads one. The decode steps are those
of the report's ``generate`` measurement: torchtune's ``generate_next_token`` at batch 1 after a 16-token prompt,
with the masks and positions torchtune's ``generate`` passes (its per-step bookkeeping, the same for both models,
is left out). Reported:

1. **Operators per decode step** (aten ops recorded by the profiler: deterministic, so robust to a busy machine),
   for the whole step and per call of each layer kind: plain layer, routed layer that runs its token or skips it,
   dropped layer, and the rest (embedding, head, sampling).
2. **Self-CPU time by operator** of the same profiled steps: shares, since the absolute times of a busy machine
   are not worth much.
3. With ``--rounds R``: wall time per layer call of each kind (no profiler; forward hooks with a clock), and the
   report's measurement itself (``side_by_side.generate_tokens_per_s``: caches set up, prefill, ``--new-tokens``
   greedy tokens, the models interleaved), as medians and as the median of per-round ratios.

Results: ``--out DIR`` (``results.json``, ``results.md``).
"""

import argparse
import collections
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torchtune import config, generation
from torchtune.modules.common_utils import delete_kv_caches

from benchmarks.common import REPO, results_dir, set_threads
from torchtune_dtf.evaluation import side_by_side
from torchtune_dtf.evaluation.routing_report import load_config, load_trained
from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutedTransformerDecoder
from torchtune_dtf.modules.layers import DroppedLayer
from torchtune_dtf.training.compile import compile_layers

CONFIGS = {
    "dense": REPO / "configs" / "quickstart" / "dense_smollm2.yaml",
    "routed": REPO / "configs" / "quickstart" / "eval_recommended_0_81_smollm2.yaml",
}
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def build_models(
    checkpoint: Optional[Path], seed: int = 0, configs: Dict[str, Path] = CONFIGS
) -> Dict[str, torch.nn.Module]:
    """Each config's model in eval mode: random weights under ``seed`` (each model from the same seed), or the
    weights of ``checkpoint`` (an ``epoch_N`` or stock HF folder, as ``routing_report`` loads them)."""
    models = {}
    for name, path in configs.items():
        cfg = load_config(path)
        if checkpoint is not None:
            models[name] = load_trained(cfg, checkpoint)
        else:
            torch.manual_seed(seed)
            models[name] = config.instantiate(cfg.model).eval()
    return models


class Decode:
    """Greedy decode steps of ``model`` at batch 1 after ``prompt [1, P]``, as torchtune's ``generate`` runs them:
    ``start()`` sets up caches and runs the prefill, ``step()`` one ``generate_next_token`` with the step's
    mask row ``[1, 1, P + steps]`` and position ``[1]``, ``stop()`` deletes the caches."""

    def __init__(self, model, prompt: torch.Tensor, steps: int) -> None:
        self.model, self.prompt = model, prompt
        self.total = prompt.shape[1] + steps
        self.masks = torch.tril(torch.ones(self.total, self.total, dtype=torch.bool)).unsqueeze(0)
        self.input_pos = torch.arange(self.total).unsqueeze(0)

    def start(self) -> None:
        length = self.prompt.shape[1]
        self.model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=self.total)
        self.token, _ = generation.generate_next_token(
            self.model, input_pos=self.input_pos[:, :length].squeeze(), mask=self.masks[:, :length], x=self.prompt,
            temperature=1.0, top_k=1)
        self.position = length

    def step(self) -> None:
        pos = self.position
        self.token, _ = generation.generate_next_token(
            self.model, input_pos=self.input_pos[:, pos].contiguous(), x=self.token.clone(),
            mask=self.masks[:, pos, None, :].contiguous(), temperature=1.0, top_k=1)
        self.position += 1

    def stop(self) -> None:
        delete_kv_caches(self.model)


def layer_kind(layer) -> str:
    if isinstance(layer, RoutedSelfAttentionLayer):
        return "routed"
    return "dropped" if isinstance(layer, DroppedLayer) else "plain"


def _label_layers(model) -> List[torch.utils.hooks.RemovableHandle]:
    """Forward hooks that put each decoder layer's call inside a ``record_function`` named by its kind."""
    handles = []
    for layer in model.layers:
        label = f"layer:{layer_kind(layer)}"

        def pre(module, args, kwargs, label=label):
            module._decode_ops_scope = record_function(label)
            module._decode_ops_scope.__enter__()

        def post(module, args, kwargs, out):
            module._decode_ops_scope.__exit__(None, None, None)

        handles += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                    layer.register_forward_hook(post, with_kwargs=True)]
    return handles


def _aten_below(event) -> List[str]:
    """Names of the aten ops at or below ``event`` in the profiler's tree."""
    names, stack = [], list(event.cpu_children)
    while stack:
        child = stack.pop()
        if child.name.startswith("aten::"):
            names.append(child.name)
        stack.extend(child.cpu_children)
    return names


@torch.inference_mode()
def profile_steps(model, prompt: torch.Tensor, steps: int, warmup: int = 4, per_layer: bool = True) -> Dict:
    """Operators per decode step (total and, with ``per_layer``, per layer call of each kind) and self-CPU by
    operator over ``steps`` profiled decode steps (after ``warmup`` unprofiled ones). ``per_layer`` hooks each
    layer's call, which a compiled layer would trace into its graph: off for compiled models."""
    decode = Decode(model, prompt, warmup + steps)
    decode.start()
    for _ in range(warmup):
        decode.step()
    handles = _label_layers(model) if per_layer else []
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                decode.step()
    finally:
        for handle in handles:
            handle.remove()
        decode.stop()
    events = prof.events()
    per_kind: Dict[str, List[int]] = collections.defaultdict(list)
    for event in events:
        if event.name.startswith("layer:"):
            ops = _aten_below(event)
            kind = event.name[len("layer:"):]
            if kind == "routed":  # a routed layer's token ran the block when its call attended
                kind = "routed (ran)" if "aten::scaled_dot_product_attention" in ops else "routed (skipped)"
            per_kind[kind].append(len(ops))
    self_us = collections.Counter()
    for event in events:
        if event.name.startswith("aten::"):
            self_us[event.name] += event.self_cpu_time_total
    total_ops = sum(1 for event in events if event.name.startswith("aten::"))
    in_layers = sum(sum(counts) for counts in per_kind.values())
    total_self = sum(self_us.values())
    return {
        "ops_per_step": total_ops / steps,
        "ops_per_step_outside_layers": (total_ops - in_layers) / steps,
        "ops_per_layer_call": {kind: statistics.median(counts) for kind, counts in sorted(per_kind.items())},
        "layer_calls_per_step": {kind: len(counts) / steps for kind, counts in sorted(per_kind.items())},
        "gemm_self_share": sum(self_us[op] for op in GEMM_OPS) / total_self,
        "self_share_by_op": {op: t / total_self for op, t in self_us.most_common()},
    }


@torch.inference_mode()
def layer_call_times(models: Dict[str, torch.nn.Module], prompt: torch.Tensor, steps: int, rounds: int) -> Dict:
    """Median wall µs per decoder-layer call of each kind and per decode step over ``rounds`` rounds of ``steps``
    decode steps, the models interleaved, after one untimed round each (no profiler: forward hooks read a clock)."""
    times: Dict[str, Dict[str, List[float]]] = {name: collections.defaultdict(list) for name in models}
    timing = {"on": False}
    handles = []
    for name, model in models.items():
        for layer in model.layers:
            def pre(module, args, kwargs):
                module._decode_ops_t0 = time.perf_counter()

            def post(module, args, kwargs, out, name=name, kind=layer_kind(layer)):
                elapsed = time.perf_counter() - module._decode_ops_t0
                if kind == "routed":  # it ran its token when its executed counter moved (read after the clock)
                    executed = int(module.routing_counts()[0])
                    kind = "routed (ran)" if executed > module._decode_ops_executed else "routed (skipped)"
                    module._decode_ops_executed = executed
                if timing["on"]:
                    times[name][kind].append(elapsed)

            handles += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                        layer.register_forward_hook(post, with_kwargs=True)]
            layer._decode_ops_executed = 0
    names = list(models)
    try:
        for r in range(rounds + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                decode = Decode(models[name], prompt, steps)
                decode.start()
                for layer in models[name].layers:
                    if isinstance(layer, RoutedSelfAttentionLayer):
                        layer._decode_ops_executed = int(layer.routing_counts()[0])
                timing["on"] = r > 0
                for _ in range(steps):
                    start = time.perf_counter()
                    decode.step()
                    if timing["on"]:
                        times[name]["step"].append(time.perf_counter() - start)
                timing["on"] = False
                decode.stop()
    finally:
        for handle in handles:
            handle.remove()
    return {name: {kind: 1e6 * statistics.median(t) for kind, t in sorted(kinds.items())}
            for name, kinds in times.items()}


def generate_times(models: Dict[str, torch.nn.Module], prompt: torch.Tensor, new_tokens: int, rounds: int) -> Dict:
    """The report's measurement (``side_by_side``'s greedy generate, interleaved, one warm-up each), as seconds per
    round, tokens/s of the medians and the median per-round speed-up of each model over the first."""
    fns: Dict[str, Callable[[], object]] = {
        name: (lambda m=model: side_by_side._greedy(m, prompt, new_tokens, None)) for name, model in models.items()}
    with torch.inference_mode():
        seconds = side_by_side._interleaved(fns, rounds)
    base = next(iter(models))
    return {
        "seconds": seconds,
        "tokens_per_s": {name: new_tokens / statistics.median(t) for name, t in seconds.items()},
        "speedup_over_" + base: {name: statistics.median(b / t for b, t in zip(seconds[base], times))
                                 for name, times in seconds.items()},
    }


def render(results: Dict) -> str:
    ops = results["ops"]
    dense, routed = ops["dense"], ops["routed"]
    lines = [
        f"# Routed decode at batch 1 against dense ({results['date']})", "",
        f"`{results['command']}`; {results['weights']}; {results['machine']}.", "",
        "## aten operators per decode step (profiler; deterministic)", "",
        "| | dense | routed | routed / dense |", "|---|---|---|---|",
        f"| whole step | {dense['ops_per_step']:.0f} | {routed['ops_per_step']:.0f} | "
        f"{routed['ops_per_step'] / dense['ops_per_step']:.2f} |",
    ]
    if routed["ops_per_layer_call"]:  # counted per layer (eager)
        lines.append(f"| outside the layers (embedding, head, sampling) | {dense['ops_per_step_outside_layers']:.0f} | "
                     f"{routed['ops_per_step_outside_layers']:.0f} | |")
    plain = dense["ops_per_layer_call"].get("plain")
    for kind, count in routed["ops_per_layer_call"].items():
        calls = routed["layer_calls_per_step"][kind]
        lines.append(f"| per call of a {kind} layer ({calls:.1f} calls per step) | {plain:.0f} (plain) | {count:.0f} | "
                     f"{count / plain:.2f} |")
    lines += ["", "## Self-CPU time by operator (shares of the profiled steps)", "",
              "| operator | dense | routed |", "|---|---|---|"]
    for op in list(routed["self_share_by_op"])[:12]:  # the routed step's largest, beside dense's share of each
        shares = [ops[name]["self_share_by_op"].get(op) for name in ("dense", "routed")]
        lines.append(f"| {op} | " + " | ".join("–" if s is None else f"{100 * s:.1f} %" for s in shares) + " |")
    lines.append(f"| GEMMs together | {100 * dense['gemm_self_share']:.1f} % | "
                 f"{100 * routed['gemm_self_share']:.1f} % |")
    if "layer_call_us" in results:
        lines += ["", "## Wall time per call, medians (µs; no profiler)", "",
                  "| | " + " | ".join(results["layer_call_us"]) + " |",
                  "|---|" + "---|" * len(results["layer_call_us"])]
        kinds = dict.fromkeys(k for t in results["layer_call_us"].values() for k in t)
        for kind in kinds:
            lines.append(f"| {kind} | " + " | ".join(
                f"{t[kind]:.0f}" if kind in t else "–" for t in results["layer_call_us"].values()) + " |")
    if "generate" in results:
        gen = results["generate"]
        speedup = gen["speedup_over_dense"]["routed"]
        lines += ["", f"## The report's generate measurement ({results['new_tokens']} tokens after 16, "
                      f"{results['rounds']} interleaved rounds)", "",
                  f"tokens/s dense {gen['tokens_per_s']['dense']:.1f}, routed {gen['tokens_per_s']['routed']:.1f} "
                  f"(ratio of medians {gen['tokens_per_s']['routed'] / gen['tokens_per_s']['dense']:.3f}); "
                  f"median per-round speed-up {speedup:.3f}."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path,
                        help="HF or epoch_N folder for both models (default: random weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="profiled decode steps")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (0: operators and shares only)")
    parser.add_argument("--new-tokens", type=int, default=40, help="tokens of the timed generate (the report's 40)")
    parser.add_argument("--compiled", action="store_true",
                        help="compile every layer first (compile_layers, static caches; the first calls compile)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 profiled steps, no timing")
    parser.add_argument("--out", type=Path, help="write results.json and results.md here")
    parser.add_argument("--overwrite", action="store_true", help="replace the results an existing --out holds")
    args = parser.parse_args(argv)
    if args.out:
        args.out = results_dir(args.out, args.out, overwrite=args.overwrite)
    if args.quick:
        args.steps, args.rounds = 4, 0
    set_threads(args.threads)
    models = build_models(args.checkpoint, args.seed)
    prompt = torch.randint(0, models["dense"].tok_embeddings.num_embeddings, (1, 16),
                           generator=torch.Generator().manual_seed(args.seed + 1))
    if args.compiled:
        for model in models.values():
            if isinstance(model, RoutedTransformerDecoder):
                model.use_static_kv_caches()
            compile_layers(model)
        with torch.inference_mode():  # compile every graph the measurements reach before any of them
            for model in models.values():
                side_by_side._greedy(model, prompt, args.new_tokens, None)
    results = {
        "date": date.today().isoformat(),
        "command": "python -m benchmarks.decode_ops " + " ".join(sys.argv[1:] if argv is None else argv),
        "weights": f"weights of {args.checkpoint}" if args.checkpoint else f"random weights, seed {args.seed}",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, fp32, "
                   + ("compiled (inductor, per layer)" if args.compiled else "eager"),
        "ops": {name: profile_steps(model, prompt, args.steps, per_layer=not args.compiled)
                for name, model in models.items()},
    }
    if args.rounds:
        results["rounds"], results["new_tokens"] = args.rounds, args.new_tokens
        if not args.compiled:  # the clock's hooks would run inside the compiled layers
            results["layer_call_us"] = layer_call_times(models, prompt, args.new_tokens - 1, args.rounds)
        results["generate"] = generate_times(models, prompt, args.new_tokens, args.rounds)
    text = render(results)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.md").write_text(text)
    return results


if __name__ == "__main__":
    main()
