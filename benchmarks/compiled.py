"""Compiled and eager, routed against dense, for the recipes the study recommends (issue 47 §5).

    python -m benchmarks.compiled                          # SmolLM2-135M shape, the study's recipes exactly as trained
    python -m benchmarks.compiled --shape 0_5b             # Qwen2.5-0.5B shape, the papers' setting (MoD / SDT / STT)
    python -m benchmarks.compiled --shape tiny --quick     # smoke run, a minute

One process builds every model with random weights and one shared backbone (``common.build_sharing``), then
times each workload for every model in interleaved rounds (A B C, B C A, …), eager and compiled
(``torchtune_dtf.training.compile``: prefill and training with every layer compiled by inductor; decoding through one
compiled ``generate_next_token`` over static KV caches, as ``routed_generate`` decodes with ``compile: True``: one
graph per step, replayed as a CUDA graph on a GPU, the gpt-fast pattern; ``--decode-compile layers`` compiles the
layers one by one instead). Each ratio is the median over rounds of
the per-round ratio against dense *in the same mode*; beside it the closed-form FLOP ratio (the ideal,
``closed_form.py``) and, per call, the operators the CPU ran (aten ops in the profiler).

Workloads: prefill b1 × T (the full-prompt forward of log-likelihood evaluation, no cache; per-sequence top-k
student, exactly ⌊γ·T⌋ tokens per routed layer), greedy decode b1 at context C (a threshold student calibrated
to execute γ of the prompt's tokens; top-k needs ⌊γ·b⌋ ≥ 1 rows, so b1 cannot use it), decode b8 at context C
with the top-k student (the per-step budget, static shapes), and one training step b1 × T_train (teacher
forward + backward of the LM and auxiliary losses; the distillation teacher's forward is left out, as it is the
dense model's). Results: ``benchmarks/results/compiled_<shape>/results.{json,md}``.
"""

import argparse
import json
import math
import platform
import sys
import time
from datetime import date
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from torchtune import generation
from torchtune.modules.common_utils import delete_kv_caches

from torchtune_dtf import closed_form as cf
from benchmarks.common import (
    REPO,
    build_sharing,
    calibrate_student_threshold,
    cast_params,
    causal_cache_mask,
    config_routing,
    interleaved,
    median,
    paired_ratio,
    results_dir,
    set_threads,
    subnormals_flushed,
    sync,
)
from torchtune_dtf.models import qwen2_5
from torchtune_dtf.models.qwen2_5 import QWEN2_5_SHAPES
from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext
from torchtune_dtf.training.compile import compile_layers, compiled_decode_step
from torchtune_dtf.training.routing_losses import training_loss

FRONTIER = "experiments/frontier/study.yaml"
BUDGET = "experiments/budget_cpu200/study.yaml"
SKIP_MAPS = "experiments/skip_maps/study.yaml"
#: SmolLM2-135M shape: (label, study file, run name). The study's recommended recipe at each level next to
#: layer dropping at about its FLOPs, and the papers' setting, each built from the run's config + overrides.
SMOLLM2_RECIPES = [
    ("dense", FRONTIER, "dense"),
    ("stt_papers_50", FRONTIER, "stt_papers_50"),
    ("hybrid_0.90", BUDGET, "stt_d4_bi2_g625_all_nocurr_fixedcrit_bias_rlr10"),
    ("layerdrop_4", FRONTIER, "layerdrop_4_distill_bias"),
    ("layerdrop_5", BUDGET, "layerdrop_5_distill_bias"),
    ("hybrid_0.81", BUDGET, "stt_d5_bi6_all_nocurr_fixedcrit_bias_rlr10"),
    # the quickstart's recipe: the ≈ 0.81 hybrid with skip linear maps (configs/quickstart/recommended_0_81_linear_*)
    ("hybrid_0.81_linear", SKIP_MAPS, "recipe_linear"),
    ("layerdrop_7", FRONTIER, "layerdrop_7_distill"),
    ("layerdrop_8", BUDGET, "layerdrop_8_distill"),
    ("hybrid_0.72", FRONTIER, "stt_d6_bi10_all_rlr10"),
    ("layerdrop_10", FRONTIER, "layerdrop_10_distill"),
]
#: Layer dropping the recommended recipe at each level is compared with (about the same FLOPs).
BASELINE_OF = {"hybrid_0.90": "layerdrop_4", "hybrid_0.81": "layerdrop_7", "hybrid_0.81_linear": "layerdrop_7",
               "hybrid_0.72": "layerdrop_10"}


def study_run(study_file: str, name: str) -> Dict:
    """A run's definition (config file, overrides) as the study driver resolves it from a study YAML (its parts
    and ``runs_from`` followed; the config path absolute)."""
    from experiments.spec import load_study

    for run in load_study(REPO / study_file, root=REPO)["runs"]:
        if run["name"] == name:
            return run
    raise KeyError(f"{study_file} defines no run {name!r}")


def model_section(study_file: str, name: str) -> Dict:
    """The run's ``model`` config section with its ``model.*`` overrides applied (``_component_`` dropped)."""
    run = study_run(study_file, name)
    section = OmegaConf.to_container(OmegaConf.load(REPO / run["config"]).model, resolve=True)
    for key, value in run["overrides"].items():
        if key.startswith("model."):
            section[key.removeprefix("model.")] = value
    section.pop("_component_")
    return section


def plan_models(shape: str) -> Dict[str, Dict]:
    """``{label: routed_qwen2 kwargs}`` (architecture + routing) for the shape's benchmark set."""
    if shape == "smollm2":
        return {label: model_section(study, name) for label, study, name in SMOLLM2_RECIPES}
    architecture = dict(QWEN2_5_SHAPES[shape])
    if shape == "tiny":
        architecture.update(vocab_size=512, max_seq_len=256)
    models = {"dense": dict(architecture, variant="dense")}
    for variant in ("mod", "sdt", "stt"):
        routing = config_routing(variant)
        routing.update(routed_layers="every_other", gate="scaled", always_run_first_token=False)  # the papers
        models[f"{variant}_papers_50"] = dict(architecture, variant=variant, **routing)
    return models


def with_student(section: Dict, student: str) -> Dict:
    """The section with the timing's student: ``topk`` (exact ⌊γ·n⌋; whole-sequence top-k permitted for a
    cache-less prefill) or ``threshold`` (calibrated afterwards)."""
    if section["variant"] in ("dense", "layerdrop", "random"):
        return section
    section = dict(section)
    if student == "topk":
        section.update(student_routing_mode="topk", student_threshold=None, allow_noncausal_student_topk=True)
    else:
        section.update(student_routing_mode="threshold", student_threshold=0.5)
    return section


def build_models(sections: Dict[str, Dict], student: str, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> Dict[str, torch.nn.Module]:
    """Every model of ``sections`` on ``device``, floating parameters in ``dtype`` (buffers such as RoPE tables
    keep theirs), all sharing the dense model's backbone parameter objects."""
    torch.manual_seed(seed)
    dense = qwen2_5.routed_qwen2(**sections["dense"]).eval()
    models = {"dense": dense}
    for label, section in sections.items():
        if label != "dense":
            section = with_student(section, student)
            models[label] = build_sharing(dense, lambda s=section: qwen2_5.routed_qwen2(**s), seed=seed)
    for model in models.values():
        model.to(device)  # in place: shared parameters stay shared
        cast_params(model, dtype)
    return models


def _decode_b1_load(routing, fractions: Dict[int, float], context: int):
    """A batch-1 decode step's load per routed layer at the measured executed ``fractions`` (γ where none):
    ``rows`` (the share of steps the layer runs) and ``kv`` (cache entries read per step: a running row reads every
    entry when skipped tokens keep their K/V, else the layer's share of the context)."""
    rows = {i: fractions.get(i, g) for i, g in routing.gamma_of().items()}
    kv = {i: rows[i] * (context if routing.skipped_tokens_write_kv else rows[i] * context) for i in rows}
    return rows, kv


def flop_ratios(sections: Dict[str, Dict], prefill_len: int, context: int, context_b8: int, train_len: int,
                executed: Dict[str, Dict[int, float]], decode_batches=(8,)) -> Dict[str, Dict[str, float]]:
    """Closed-form routed/dense FLOP ratios: prefill (⌊γ·T⌋ per routed layer), decode b1 at ``context`` with the
    measured executed fractions, training step (teacher mode)."""
    out = {}
    shape = cf.model_shape_from_config(sections["dense"])
    dense_routing = cf.RoutingShape.dense()
    for label, section in sections.items():
        routing = cf.routing_shape_from_model_config(section, shape.num_layers, shape.embed_dim)
        rows, kv = _decode_b1_load(routing, executed.get(label, {}), context)
        out[label] = {
            "prefill": cf.flop_ratio(shape, routing, prefill_len),
            "decode_b1": cf.decode_step_flops(shape, routing, batch=1, context=context, rows=rows, kv_entries=kv)
            / cf.decode_step_flops(shape, dense_routing, batch=1, context=context),
            "train": cf.flop_ratio(shape, routing, train_len, training=True),
            **{f"decode_b{b}": cf.decode_step_flops(shape, routing, batch=b, context=context_b8)
               / cf.decode_step_flops(shape, dense_routing, batch=b, context=context_b8) for b in decode_batches},
        }
    return out


def byte_ratios(sections: Dict[str, Dict], context: int, context_b8: int, executed: Dict[str, Dict[int, float]],
                decode_batches=(8,), bytes_per_value: int = 4) -> Dict[str, Dict[str, float]]:
    """Closed-form routed/dense bytes one decode step reads (block weights, K/V, head, routers): the ideal where a
    step is bound by memory traffic, as small-batch decoding is. A routed layer's weights are read on every step
    on which any row runs it: at batch 1 the steps its token runs (the measured executed fraction); in a top-k
    step ⌊γ·b⌋ rows run every time, so from b ≥ 1/γ a routed layer reads all its weights and saves only arithmetic."""
    out = {}
    shape = cf.model_shape_from_config(sections["dense"])
    for label, section in sections.items():
        routing = cf.routing_shape_from_model_config(section, shape.num_layers, shape.embed_dim)
        gammas = routing.gamma_of()
        rows, kv = _decode_b1_load(routing, executed.get(label, {}), context)
        out[label] = {"decode_b1": cf.decode_bytes_ratio(
            shape, routing, bytes_per_value=bytes_per_value, batch=1, context=context, runs=rows, kv_entries=kv)["ratio"]}
        for b in decode_batches:
            running = {i: cf.num_selected(g, b) for i, g in gammas.items()}  # rows per step (top-k over rows)
            held = {i: context_b8 if routing.skipped_tokens_write_kv else g * context_b8 for i, g in gammas.items()}
            out[label][f"decode_b{b}"] = cf.decode_bytes_ratio(
                shape, routing, bytes_per_value=bytes_per_value, batch=b, context=context_b8,
                runs={i: float(n > 0) for i, n in running.items()},
                kv_entries={i: running[i] * held[i] for i in running})["ratio"]
    return out


def count_ops(fn: Callable[[], object]) -> int:
    """Operators one call runs on the CPU: aten ops recorded by the profiler (compiled kernels count as the
    ops they replaced only where inductor left them as aten calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def prefill_fns(models: Dict[str, torch.nn.Module], tokens: torch.Tensor) -> Dict[str, Callable]:
    def run(model):
        def fn():
            with torch.inference_mode():
                model(tokens)
            sync(tokens.device)
        return fn
    return {label: run(model) for label, model in models.items()}


class Decoder:
    """Decoding of ``steps`` tokens after a cached prefill of ``prompt [b, C]``: ``prepare()`` sets up the caches
    and runs the prefill (untimed), each call of the instance runs the decode steps (and waits for them).

    Each step is torchtune's ``generate_next_token`` (forward over the cache, then top-1 sampling). Its input is
    the token just sampled (greedy decoding) or, with ``forced [b, steps]``, the next token of a fixed stream: the
    same work per step, and every model decodes the same tokens. A random-weight model's own greedy output
    repeats a token or two, text unlike anything a threshold student was calibrated on, so its executed fraction
    drifts from γ (the papers' STT ran 0.67 of such tokens at γ = 0.5); on a forced stream of the calibration
    prompt's kind the students execute their budget, and the timing compares models at the FLOPs they were
    built for."""

    def __init__(self, model, prompt: torch.Tensor, steps: int, compiled: bool, dtype: torch.dtype,
                 forced: Optional[torch.Tensor] = None) -> None:
        self.model, self.prompt, self.steps, self.compiled, self.dtype = model, prompt, steps, compiled, dtype
        if forced is not None and forced.shape != (prompt.shape[0], steps):
            raise ValueError(f"forced tokens must be [batch, steps] = {[prompt.shape[0], steps]}, got {list(forced.shape)}")
        self.forced = forced
        self.step_fn = compiled_decode_step(model) if compiled else generation.generate_next_token
        batch, context = prompt.shape
        self.max_len = context + steps + 1
        self.masks = causal_cache_mask(batch, self.max_len, self.max_len, device=prompt.device)

    def prepare(self) -> None:
        if self.model.caches_are_setup():
            delete_kv_caches(self.model)
        with torch.device(self.prompt.device):
            self.model.setup_caches(batch_size=self.prompt.shape[0], dtype=self.dtype, decoder_max_seq_len=self.max_len)
        context = self.prompt.shape[1]
        with torch.inference_mode():
            self.token, _ = generation.generate_next_token(
                self.model, torch.arange(context, device=self.prompt.device), self.prompt,
                mask=self.masks[:, :context], temperature=1.0, top_k=1)
        sync(self.prompt.device)

    def __call__(self) -> None:
        self.decode(0, self.steps)

    def decode(self, start: int, stop: int) -> None:
        """Decode steps ``start`` … ``stop − 1`` after the prompt (steps before ``start`` already decoded since
        :meth:`prepare`), and wait for them."""
        batch, context = self.prompt.shape
        token = self.token
        with torch.inference_mode():
            for t in range(context + start, context + stop):
                position = torch.full((batch, 1), t, device=self.prompt.device)
                if self.forced is not None:
                    token = self.forced[:, t - context, None]
                token, _ = self.step_fn(self.model, position, token, mask=self.masks[:, t : t + 1], temperature=1.0, top_k=1)
        self.token = token
        sync(self.prompt.device)


def decode_times(decoders: Dict[str, Decoder], rounds: int, chunk: Optional[int] = None) -> Dict[str, List[float]]:
    """Per-step decode time of each model in each round, interleaved; every round re-runs each model's prefill
    (untimed).

    With ``chunk`` steps, a round decodes every model ``chunk`` steps at a time in turn (A's steps 0–7, B's 0–7,
    …, then B's 8–15, C's 8–15, …, A's), and a model's round time is the sum of its chunks: the models' steps at
    the same positions lie a second or two apart, so a busy neighbour's load on the memory bus, which drifts over
    tens of seconds, falls on all of them alike. (A chunk is not a sample of its own: at batch 1 a threshold
    student runs a different share of its tokens in each chunk, so per-chunk ratios spread with the routing, not
    with the machine.) Without it, each model decodes all its steps in one go."""
    times = {label: [] for label in decoders}
    labels = list(decoders)
    steps = next(iter(decoders.values())).steps
    chunk = chunk or steps
    if steps % chunk:
        raise ValueError(f"--decode-chunk {chunk} must divide the {steps} decode steps")
    for r in range(rounds + 1):  # round 0 warms up (compiles)
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order:
            decoders[label].prepare()
        spent = {label: 0.0 for label in labels}
        for c, start in enumerate(range(0, steps, chunk)):
            for label in order[c % len(order):] + order[: c % len(order)]:  # no model always first after a switch
                began = time.perf_counter()
                decoders[label].decode(start, start + chunk)
                spent[label] += time.perf_counter() - began
        if r:
            for label in labels:
                times[label].append(spent[label] / steps)
    return times


def train_step_fn(model, tokens: torch.Tensor) -> Callable:
    """One teacher-mode forward + backward (LM loss and the auxiliary losses with the 0.5B configs' weights)."""
    routed = any(isinstance(m, RoutedSelfAttentionLayer) for m in model.modules())

    def fn():
        routing = RoutingContext(mode="teacher", beta_ce=100.0, beta_cu=100.0) if routed else None
        logits = model(tokens, routing=routing)
        lm = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss, _ = training_loss(lm, routing, (0.05, 0.01, 0.0) if routed else None)
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync(tokens.device)
    return fn


def ratio_range(times: Dict[str, List[float]], num: str, den: str) -> Tuple[float, float]:
    """Lowest and highest per-round ratio num/den: how far the rounds behind :func:`paired_ratio`'s median spread."""
    ratios = [a / b for a, b in zip(times[num], times[den])]
    return min(ratios), max(ratios)


def summarize(times: Dict[str, List[float]], flops: Dict[str, float]) -> Dict[str, Dict]:
    return {
        label: {"median_s": median(t), "ratio": paired_ratio(times, label, "dense"), "flop_ratio": flops.get(label)}
        for label, t in times.items()
    }


def run(args) -> Dict:
    set_threads(args.threads)
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    sections = plan_models(args.shape)
    if args.models:
        unknown = sorted(set(args.models) - set(sections))
        if unknown:
            raise SystemExit(f"unknown --models {unknown}; this shape has {sorted(sections)}")
        sections = {label: sections[label] for label in ["dense", *[m for m in args.models if m != "dense"]]}
    vocab = sections["dense"]["vocab_size"]
    results: Dict = {
        "command": "python -m benchmarks.compiled " + " ".join(sys.argv[1:]),
        "date": date.today().isoformat(),
        "device": (f"{torch.cuda.get_device_name(device)}" if device.type == "cuda"
                   else f"CPU {platform.processor() or platform.machine()}, {args.threads} threads")
        + f", {args.dtype}, torch {torch.__version__}",
        "shape": args.shape, "prefill_len": args.prefill_len, "context": args.context, "context_b8": args.context_b8,
        "decode_steps": args.decode_steps, "decode_chunk": args.decode_chunk, "decode_input": args.decode_input, "decode_compile": args.decode_compile,
        "train_len": args.train_len, "rounds": args.rounds, "prefill_batch": args.prefill_batch,
        "train_batch": args.train_batch, "decode_batches": args.decode_batches, "models": {k: {kk: vv for kk, vv in v.items()
                                                                          if kk not in ("vocab_size",)}
                                                                      for k, v in sections.items()},
        "sections": {},
    }
    gen = torch.Generator().manual_seed(1)
    prompt_1 = torch.randint(0, vocab, (1, args.context), generator=gen).to(device)
    prompts = {b: torch.randint(0, vocab, (b, args.context_b8), generator=gen).to(device) for b in args.decode_batches}
    prefill_tokens = torch.randint(0, vocab, (args.prefill_batch, args.prefill_len), generator=gen).to(device)
    train_tokens = torch.randint(0, vocab, (args.train_batch, args.train_len), generator=gen).to(device)
    streams: Dict[int, Optional[torch.Tensor]] = {b: None for b in [1, *args.decode_batches]}
    if args.decode_input == "forced":  # random tokens, like the prompts and the calibration prompt
        forced_gen = torch.Generator().manual_seed(3)
        streams = {b: torch.randint(0, vocab, (b, args.decode_steps), generator=forced_gen).to(device) for b in streams}

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    executed: Dict[str, Dict[int, float]] = {}

    def save():
        # The closed-form ideals at every save (decode b1's from the fractions measured so far), so that a run
        # stopped part way (a model that fails to compile) still writes them beside the times it has.
        results["flop_ratios"] = flop_ratios(sections, args.prefill_len, args.context, args.context_b8,
                                             args.train_len, executed, args.decode_batches)
        results["byte_ratios"] = byte_ratios(sections, args.context, args.context_b8, executed, args.decode_batches,
                                             bytes_per_value=2 if args.dtype == "bf16" else 4)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "results.md").write_text(render(results))

    with subnormals_flushed(True):
        for mode in args.modes:
            compiled = mode == "compiled"
            torch._dynamo.reset()
            section = results["sections"].setdefault(mode, {})
            # Threshold students (decode b1), calibrated to execute γ of a calibration prompt.
            models = build_models(sections, "threshold", device, dtype)
            calib = torch.randint(0, vocab, (1, min(256, args.context)), generator=torch.Generator().manual_seed(2)).to(device)
            for label, model in models.items():
                layers = [m for m in model.modules() if isinstance(m, RoutedSelfAttentionLayer)]
                if layers:
                    capacity = {m.layer_idx: m.capacity for m in layers}
                    after = calibrate_student_threshold(model, calib, median(capacity.values()))
                    executed.setdefault(label, after)
            # A compiled decode step is one graph of every layer, as routed_generate compiles it (on a GPU CUDA
            # graphs replay it); measured on the CPU it is faster than the layers compiled one by one, for dense
            # (0.5B shape: 80 against 92 ms per step) and routed models alike.
            whole_step = compiled and args.decode_compile == "step"
            if compiled and not whole_step:
                for model in models.values():
                    model.use_static_kv_caches()
                    compile_layers(model)
            if "decode_b1" in args.workloads:
                log(f"{mode}: decode b1 at context {args.context}")
                decoders = {label: Decoder(model, prompt_1, args.decode_steps, whole_step, dtype, streams[1])
                            for label, model in models.items()}
                times = decode_times(decoders, args.rounds, args.decode_chunk)
                for label, model in models.items():
                    decoders[label].prepare()
                    if hasattr(model, "reset_routing_counters"):
                        model.reset_routing_counters()
                    decoders[label]()
                    executed[label] = model.executed_fractions() if hasattr(model, "executed_fractions") else {}
                ops = {}
                for label, decoder in decoders.items():
                    decoder.prepare()
                    decoder()  # warm: the first calls of a compiled step can still run eager code
                    decoder.prepare()
                    one = Decoder.__new__(Decoder)
                    one.__dict__.update(decoder.__dict__, steps=1)
                    ops[label] = count_ops(one)
                section["decode_b1"] = {"times": times, "ops_per_step": ops, "executed_fraction": executed.copy()}
                for model in models.values():
                    delete_kv_caches(model)
                save()
            del models
            models = build_models(sections, "topk", device, dtype)
            if compiled:
                for model in models.values():
                    model.use_static_kv_caches()
                    if not whole_step:
                        compile_layers(model)
            for batch in args.decode_batches if "decode_topk" in args.workloads else ():
                log(f"{mode}: decode b{batch} at context {args.context_b8} (top-k student)")
                decoders = {label: Decoder(model, prompts[batch], args.decode_steps, whole_step, dtype,
                                            streams[batch])
                            for label, model in models.items()}
                section[f"decode_b{batch}"] = {"times": decode_times(decoders, args.rounds, args.decode_chunk)}
                for model in models.values():
                    delete_kv_caches(model)
                save()
            if whole_step:  # prefill and the training step compile layer by layer, as torchtune's compile: True
                for model in models.values():
                    compile_layers(model)
            if "prefill" in args.workloads:
                log(f"{mode}: prefill b{args.prefill_batch} × {args.prefill_len}")
                fns = prefill_fns(models, prefill_tokens)
                times = interleaved(fns, rounds=args.rounds, warmup=1)
                section["prefill"] = {"times": times}
                save()
            if "train" in args.workloads:
                log(f"{mode}: training step b{args.train_batch} × {args.train_len}")
                for model in models.values():
                    model.train()
                fns = {label: train_step_fn(model, train_tokens) for label, model in models.items()}
                section["train"] = {"times": interleaved(fns, rounds=args.rounds, warmup=2)}
                for model in models.values():
                    model.eval()
                save()
            del models
    save()
    return results


def render(results: Dict) -> str:
    flops = results.get("flop_ratios", {})
    nbytes = results.get("byte_ratios", {})
    lines = [
        f"# Compiled and eager, routed / dense ({results['shape']} shape)", "",
        f"`{results['command']}` — {results['date']}, {results['device']}; median over {results['rounds']} "
        "interleaved rounds of each round's model/dense ratio in the same mode (dense = 1), the rounds' lowest and "
        "highest in brackets. FLOPs: closed form (`torchtune_dtf/closed_form.py`), the ideal where arithmetic bounds "
        "the step; bytes read: the closed form's decode traffic (weights of every layer any row runs, K/V, head), the "
        "ideal where memory does, as in small-batch decoding. Decode steps read "
        + ("a fixed random token stream (the same for every model)" if results.get("decode_input", "greedy") == "forced"
           else "the token each model sampled (greedy)") + ". Compiled decoding: "
        + ("the layers compiled one by one." if results.get("decode_compile", "layers") == "layers"
           else "one compiled `generate_next_token` per step (every layer in one graph, as `routed_generate` with "
                "`compile: True`).")
        + (f" Decoding interleaves the models {results['decode_chunk']} steps at a time within each round."
           if results.get("decode_chunk") else ""), "",
    ]
    workloads = [("prefill", f"prefill b{results.get('prefill_batch', 1)} × {results['prefill_len']}"),
                 ("decode_b1", f"decode b1, context {results['context']} (threshold student)"),
                 *((f"decode_b{b}", f"decode b{b}, context {results['context_b8']} (top-k student)")
                   for b in results.get("decode_batches", [8])),
                 ("train", f"training step b{results.get('train_batch', 1)} × {results['train_len']}")]
    for key, title in workloads:
        rows = []
        for label in results["models"]:
            ratio = flops.get(label, {}).get(key)
            cells = [label]
            for mode in ("eager", "compiled"):
                entry = results["sections"].get(mode, {}).get(key)
                if entry is None:
                    cells += ["", "", ""]
                    continue
                times = entry["times"]
                low, high = ratio_range(times, label, "dense")
                spread = f" ({low:.2f}–{high:.2f})" if label != "dense" and len(times[label]) > 1 else ""
                time_ratio = paired_ratio(times, label, "dense")
                cells += [f"{1e3 * median(times[label]):.1f}", f"{time_ratio:.3f}{spread}",
                          f"{time_ratio - ratio:+.3f}" if ratio is not None and label != "dense" else ""]
            cells.append(f"{ratio:.3f}" if ratio is not None else "")
            byte_ratio = nbytes.get(label, {}).get(key)
            cells.append(f"{byte_ratio:.3f}" if byte_ratio is not None else "")
            rows.append(cells)
        if not any(any(c for c in row[1:7]) for row in rows):
            continue
        lines += [f"## {title}", "",
                  "| model | eager ms | eager / dense | eager − FLOPs | compiled ms | compiled / dense | compiled − FLOPs "
                  "| FLOPs / dense | bytes read / dense |",
                  "|---|---|---|---|---|---|---|---|---|", *("| " + " | ".join(r) + " |" for r in rows), ""]
        if key == "decode_b1":
            for mode in ("eager", "compiled"):
                entry = results["sections"].get(mode, {}).get(key)
                if entry:
                    ops = entry["ops_per_step"]
                    lines.append(f"aten ops per decode step ({mode}): " + ", ".join(
                        f"{label} {n} ({n / ops['dense']:.2f}×)" for label, n in ops.items()))
            entry = results["sections"].get("eager", {}).get(key) or results["sections"].get("compiled", {}).get(key)
            if entry:
                lines.append("executed fraction per routed layer in decode (budget γ): " + "; ".join(
                    f"{label} {sum(f.values()) / len(f):.2f}" for label, f in entry["executed_fraction"].items() if f))
            lines.append("")
    comparisons = []
    for hybrid, baseline in BASELINE_OF.items():
        if hybrid not in results["models"] or baseline not in results["models"]:  # a pair needs both runs
            continue
        for mode in ("eager", "compiled"):
            for key, title in workloads:
                entry = results["sections"].get(mode, {}).get(key)
                if entry:
                    t = entry["times"]
                    rounds = [(h - b) / d for h, b, d in zip(t[hybrid], t[baseline], t["dense"])]
                    flop_gap = flops.get(hybrid, {}).get(key, math.nan) - flops.get(baseline, {}).get(key, math.nan)
                    comparisons.append(f"| {hybrid} vs {baseline} | {mode} | {title} | "
                                       f"{paired_ratio(t, hybrid, 'dense') - paired_ratio(t, baseline, 'dense'):+.3f} | "
                                       f"{median(rounds):+.3f} ({min(rounds):+.3f} … {max(rounds):+.3f}) | "
                                       f"{flop_gap:+.3f} | {median(rounds) - flop_gap:+.3f} |")
    if comparisons:
        lines += ["## Recommended recipe − layer dropping at about its FLOPs (time / dense)", "",
                  "Time difference recipe − layer dropping (per dense time), beside the difference of their closed-form "
                  "FLOPs; the last column is the time difference at equal FLOPs (time difference − FLOP difference), "
                  "what routing costs beyond the compute it does.", "",
                  "| pair | mode | workload | difference of the medians | median of the rounds' differences (lowest … "
                  "highest) | FLOP difference | at equal FLOPs |",
                  "|---|---|---|---|---|---|---|", *comparisons, ""]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2", choices=["smollm2", "0_5b", "tiny"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--context-b8", type=int, default=256, help="prompt length of the top-k (batched) decodes")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[8], help="batch sizes of the top-k decodes")
    parser.add_argument("--prefill-batch", type=int, default=1)
    parser.add_argument("--train-batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--decode-chunk", type=int, default=None,
                        help="within a round, decode every model this many steps at a time in turn "
                             "(default: the whole --decode-steps in one go)")
    parser.add_argument("--decode-input", default="forced", choices=["forced", "greedy"],
                        help="what each decode step reads: a fixed random token stream (default) or the token it sampled")
    parser.add_argument("--models", nargs="+", default=None, help="labels to run (dense is always run)")
    parser.add_argument("--decode-compile", default="step", choices=["step", "layers"],
                        help="compiled decoding: one graph per step (default, as routed_generate) or per layer")
    parser.add_argument("--train-len", type=int, default=512)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--workloads", nargs="+", default=["prefill", "decode_b1", "decode_topk", "train"],
                        choices=["prefill", "decode_b1", "decode_topk", "train"])
    parser.add_argument("--quick", action="store_true", help="short lengths and one round (smoke run)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/compiled_<shape>, or the first free _2, _3, …")
    parser.add_argument("--overwrite", action="store_true", help="replace the results an existing --out holds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.prefill_len, args.context, args.context_b8, args.decode_steps, args.train_len = 1, 64, 64, 32, 16, 64
    args.out = str(results_dir(args.out, REPO / "benchmarks" / "results" / f"compiled_{args.shape}{'_quick' if args.quick else ''}",
                               overwrite=args.overwrite))
    return run(args)


if __name__ == "__main__":
    main()
