"""Routed vs dense benchmarks: one entry point for every measurement of issue #4.

    python -m benchmarks.run                      # full suite, Qwen2.5-0.5B shape, 1 thread
    python -m benchmarks.run --quick              # shorter suite (fewer shapes and repetitions)
    python -m benchmarks.run flops decode         # only some sections
    python -m benchmarks.run --size tiny --quick  # smoke run on the tiny shape (seconds)

Sections: flops, prefill, train, decode (includes the KV-cache accounting), overhead, naive.
Every ratio is routed/dense measured in the same process, printed next to the closed form that
``torchtune_dtf/closed_form.py`` computes for the shape that runs. Results go to ``--out`` (JSON + Markdown).
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

# Process environment, fixed before torch (and glibc's malloc) start:
# * threads: the box is 2 shared cores (see benchmarks/README.md);
# * malloc: buffers of a few hundred MB (the [V, d] tied-embedding gradients, the [b, T, V] logits) are
#   otherwise mmap'd fresh and page-faulted on every use, which on this VM costs seconds per training step
#   and varies 2× between identical steps. Keeping freed memory in the heap makes a step's time the work's.
#   Both models run under the same setting; set BENCH_SYSTEM_MALLOC=1 to measure with glibc's defaults.
MALLOC_REUSE = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(10**11), "MALLOC_TOP_PAD_": str(10**9)}
if __name__ == "__main__":
    _threads = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--threads"), None)
    os.environ["OMP_NUM_THREADS"] = _threads or os.environ.get("BENCH_THREADS", "1")
    os.environ["MKL_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    if not os.environ.get("BENCH_SYSTEM_MALLOC") and any(os.environ.get(k) != v for k, v in MALLOC_REUSE.items()):
        os.environ.update(MALLOC_REUSE)  # glibc reads these at start-up: run again under them
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.run", *sys.argv[1:]])

import torch
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.common_utils import delete_kv_caches
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_dtf import closed_form as cf
from benchmarks.common import (
    build_dense,
    build_like,
    calibrate_student_threshold,
    categorize_flops,
    config_loss_weights,
    causal_cache_mask,
    config_routing,
    flop_counter,
    interleaved,
    median,
    paired_ratio,
    profile_ops,
    routed_layers,
    routing_for,
    set_threads,
    shapes_for,
    subnormals_flushed,
    timed,
)
from torchtune_dtf.modules import RoutingContext
from torchtune_dtf.modules.layers import sequence_starts, token_positions
from torchtune_dtf.modules.routed_block import _attention_mask
from torchtune_dtf.modules.selection import gather_tokens, mask_selection, scatter_updates
from torchtune_dtf.training.routing_losses import training_loss

SECTIONS = ("flops", "prefill", "train", "decode", "overhead", "naive")
GAMMA = 0.5
BAR_TIME = 1.05  # timing bars: routed/dense ≤ 1.05 × closed-form ratio
BAR_FLOPS = 0.02  # FLOP bar: within 2 % of closed form (+ routers)
BAR_OVERHEAD = 0.05  # routing overhead ≤ 5 % of a dense layer

# What each section runs, per shape; "quick" entries override the full plan.
PLANS = {
    "0_5b": dict(
        flops_seq=512, flops_gammas=(0.25, 0.5, 0.75),
        prefill=[(1, 512), (1, 1024), (4, 512), (4, 1024)], prefill_rounds={1: 5, 4: 2},
        prefill_threshold=[(4, 512)],
        train=[(1, 512), (1, 1024)], train_rounds=7, train_warmup=3, train_breakdown_rounds=5,
        decode_ctx=(1024, 2048), decode_batch=(1, 8), decode_steps=8, decode_warmup=2, calib_seq=256,
        overhead_seq=1024, overhead_rounds=5, overhead_ragged_batch=4,
        naive_seq=1024, naive_model=(1, 512), naive_rounds=3,
        quick=dict(flops_gammas=(0.5,), prefill=[(1, 512), (4, 512)], prefill_rounds={1: 3, 4: 1}, prefill_threshold=[],
                   train=[(1, 128)], train_rounds=3, train_breakdown_rounds=2, decode_ctx=(1024,), decode_steps=6, overhead_rounds=3,
                   naive_model=None, naive_rounds=2),
    ),
    "tiny": dict(
        flops_seq=64, flops_gammas=(0.25, 0.5, 0.75),
        prefill=[(1, 64), (2, 64)], prefill_rounds={1: 1, 2: 1}, prefill_threshold=[(2, 64)],
        train=[(2, 32)], train_rounds=1, train_warmup=1, train_breakdown_rounds=1,
        decode_ctx=(48,), decode_batch=(1, 4), decode_steps=3, decode_warmup=1, calib_seq=64,
        overhead_seq=64, overhead_rounds=1, overhead_ragged_batch=3,
        naive_seq=64, naive_model=(1, 32), naive_rounds=1,
        quick=dict(),
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def plan_for(size: str, quick: bool) -> Dict:
    plan = dict(PLANS[size])
    overrides = plan.pop("quick")
    if quick:
        plan.update(overrides)
    return plan


# ---- profiling summary ---------------------------------------------------------------------------

_GROUPS = (
    ("attention", ("scaled_dot_product",)),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")),
    ("data movement", ("copy_", "aten::cat", "gather", "scatter", "aten::index", "index_select", "index_copy",
                       "aten::clone", "contiguous", "_to_copy", "aten::sort", "aten::topk", "nonzero", "aten::where",
                       "aten::expand", "aten::flatten", "aten::stack", "aten::zeros", "aten::empty", "aten::fill_")),
    ("elementwise/norm", ("aten::mul", "aten::add", "aten::sub", "aten::silu", "aten::pow", "aten::mean", "rsqrt",
                          "aten::neg", "sigmoid", "aten::div", "aten::sum", "aten::exp", "rms_norm", "aten::lt",
                          "aten::gt", "aten::le", "aten::ge", "aten::eq", "aten::bitwise", "aten::any", "aten::all",
                          "aten::max", "aten::cumsum", "aten::softmax", "aten::log")),
)


def profile_summary(fn, vocab_size: int, row_limit: int = 10) -> Dict:
    """Self CPU time per op group (ms) and the top ops, from one profiled call. Matmuls whose operands have
    the vocabulary dimension are the LM head (and, in training, the tied embedding's gradient)."""
    rows = profile_ops(fn)
    groups: Dict[str, float] = {}
    top: Dict[str, List] = {}
    for name, shapes, ms, calls in rows:
        group = next((g for g, keys in _GROUPS if any(k in name for k in keys)), "other")
        if group == "matmul":
            group = "matmul (LM head)" if str(vocab_size) in shapes else "matmul (blocks, routers)"
        groups[group] = groups.get(group, 0.0) + ms
        entry = top.setdefault(name, [name, 0.0, 0])
        entry[1] += ms
        entry[2] += calls
    top_ops = sorted(top.values(), key=lambda e: -e[1])[:row_limit]
    return {"groups_ms": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top_ops": [(n, round(ms, 1), c) for n, ms, c in top_ops]}


# ---- 1. FLOPs ------------------------------------------------------------------------------------


def section_flops(size: str, plan: Dict, dense) -> Dict:
    T = plan["flops_seq"]
    shape = cf.model_shape(size)
    tokens = torch.randint(0, shape.vocab_size, (1, T))
    with torch.no_grad(), flop_counter() as counter:
        dense(tokens)
    dense_meas = categorize_flops(counter)
    dense_closed = cf.forward_flops(shape, cf.RoutingShape.dense(), T)
    rows = [dict(variant="dense", gamma=1.0, measured=dense_meas, closed=dense_closed)]
    for variant in ("mod", "sdt", "stt"):
        for gamma in plan["flops_gammas"]:
            routing = routing_for(variant, capacity=gamma, student="topk")
            model = build_like(dense, variant, size, **routing)
            with torch.no_grad(), flop_counter() as counter:
                model(tokens)
            meas = categorize_flops(counter)
            _, rshape = shapes_for(size, variant, routing)
            closed = cf.forward_flops(shape, rshape, T)
            ratio = meas["total"] / dense_meas["total"]
            closed_ratio = closed["total"] / dense_closed["total"]
            ideal = (closed["total"] - closed["routers"]) / dense_closed["total"]
            rows.append(dict(
                variant=variant, gamma=gamma, measured=meas, closed=closed,
                ratio_total=ratio, ratio_attention=meas["attention"] / dense_meas["attention"],
                ratio_block_linear=meas["block_linear"] / dense_meas["block_linear"],
                closed_ratio_total=closed_ratio, closed_ideal_total=ideal,
                closed_ratio_attention=closed["attention"] / dense_closed["attention"],
                closed_ratio_block_linear=closed["block_linear"] / dense_closed["block_linear"],
                routers_share=closed["routers"] / dense_closed["total"],
                measured_routers_share=meas["routers"] / dense_meas["total"],
                passed=abs(ratio - closed_ratio) <= BAR_FLOPS * closed_ratio
                and abs(meas["attention"] - closed["attention"]) <= BAR_FLOPS * closed["attention"],
            ))
            log(f"flops {variant} γ={gamma}: measured {ratio:.4f} closed {closed_ratio:.4f} (ideal {ideal:.4f})")
    # Training forward + backward FLOPs at the training shape (deterministic, counted once per variant).
    b, Tt = plan["train"][0]
    train_rows = []
    train_tokens = torch.randint(0, shape.vocab_size, (b, Tt))
    dense_train = None
    for variant in ("dense", "mod", "sdt", "stt"):
        routing = routing_for(variant, capacity=GAMMA)
        model = build_like(dense, variant, size, **routing)
        total = count_train_flops(model, variant, train_tokens)
        _, rshape = shapes_for(size, variant, routing)
        closed = cf.train_flops(shape, rshape, Tt, batch=b)["total"]
        if variant == "dense":
            dense_train = (total, closed)
        train_rows.append(dict(variant=variant, measured=total, closed=closed,
                               ratio=total / dense_train[0], closed_ratio=closed / dense_train[1],
                               passed=abs(total - closed) <= BAR_FLOPS * closed))
    return dict(seq_len=T, rows=rows, train=dict(batch=b, seq_len=Tt, rows=train_rows))


def train_loss(model, variant: str, tokens: torch.Tensor, loss_fn) -> torch.Tensor:
    """The recipe's objective (:func:`~torchtune_dtf.training.routing_losses.training_loss`) with the shipped
    0.5B config's loss weights: LM loss through the teacher-mode forward plus the weighted auxiliary losses."""
    routing = RoutingContext(mode="teacher") if variant == "dense" else RoutingContext(mode="teacher", beta_ce=1.0, beta_cu=1.0)
    labels = torch.hstack((tokens[..., 1:], torch.full((tokens.shape[0], 1), loss_fn.ignore_index, device=tokens.device)))
    lm_loss = loss_fn(model(tokens, routing=routing), labels)
    if variant == "dense":
        return training_loss(lm_loss, None, None)[0]
    return training_loss(lm_loss, routing, config_loss_weights(variant))[0]


def count_train_flops(model, variant: str, tokens: torch.Tensor) -> int:
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    model.train()
    with flop_counter() as counter:
        train_loss(model, variant, tokens, loss_fn).backward()
    model.zero_grad(set_to_none=True)
    model.set_num_output_chunks(1)
    model.eval()
    return sum(counter.get_flop_counts()["Global"].values())


# ---- 2. prefill ----------------------------------------------------------------------------------


def section_prefill(size: str, plan: Dict, dense, profile: bool) -> Dict:
    shape = cf.model_shape(size)
    models = {"dense": dense}
    rshapes = {}
    for variant in ("mod", "stt"):
        routing = routing_for(variant, capacity=GAMMA, student="topk")
        models[variant] = build_like(dense, variant, size, **routing)
        rshapes[variant] = shapes_for(size, variant, routing)[1]
    rows, profiles = [], {}
    for b, T in plan["prefill"]:
        tokens = torch.randint(0, shape.vocab_size, (b, T))
        fns = {name: (lambda m=m: m(tokens)) for name, m in models.items()}
        with torch.inference_mode():
            times = interleaved(fns, rounds=plan["prefill_rounds"][b], warmup=1 if b == 1 else 0)
            if profile and not profiles:
                profiles = {name: profile_summary(fn, shape.vocab_size) for name, fn in fns.items()}
        for variant in ("mod", "stt"):
            closed = cf.flop_ratio(shape, rshapes[variant], T)
            ideal = cf.flop_ratio(shape, rshapes[variant], T, include_routers=False)
            ratio = paired_ratio(times, variant, "dense")
            rows.append(dict(variant=variant, batch=b, seq_len=T, dense_s=median(times["dense"]),
                             routed_s=median(times[variant]), ratio=ratio,
                             ratio_of_medians=median(times[variant]) / median(times["dense"]),
                             ratio_min=min(times[variant]) / min(times["dense"]), closed=closed, ideal=ideal,
                             bar=BAR_TIME * closed, passed=ratio <= BAR_TIME * closed, bar_applies=True,
                             times=times[variant], dense_times=times["dense"]))
            log(f"prefill b={b} T={T} {variant}: {ratio:.3f} (closed {closed:.3f}) dense {median(times['dense']):.2f}s")
    # Threshold students (the evaluation mode): rows select different counts, the executor pads to the
    # largest count and masks explicitly. Reported beside the top-k rows, with the closed form at the
    # padded counts actually executed.
    for b, T in plan.get("prefill_threshold", []):
        th_models, selected, fractions = {"dense": dense}, {}, {}
        tokens = torch.randint(0, shape.vocab_size, (b, T))
        with torch.inference_mode():
            for variant in ("mod", "stt"):
                routing = routing_for(variant, capacity=GAMMA, student="threshold")
                model = build_like(dense, variant, size, **routing)
                calibrate_student_threshold(model, torch.randint(0, shape.vocab_size, (1, plan["calib_seq"])), GAMMA)
                rc = RoutingContext(mode="student")
                model(tokens, routing=rc)
                selected[variant] = {i: int(r.selected_mask.sum(-1).max()) for i, r in rc.layers.items()}
                fractions[variant] = sum(r.selected_fraction.item() for r in rc.layers.values()) / len(rc.layers)
                th_models[variant] = model
            fns = {name: (lambda m=m: m(tokens)) for name, m in th_models.items()}
            times = interleaved(fns, rounds=plan["prefill_rounds"][b], warmup=0)
        for variant in ("mod", "stt"):
            rshape = rshapes[variant]
            closed = (cf.forward_flops(shape, rshape, T, selected=selected[variant])["total"]
                      / cf.forward_flops(shape, cf.RoutingShape.dense(), T)["total"])
            ratio = paired_ratio(times, variant, "dense")
            rows.append(dict(ratio_of_medians=median(times[variant]) / median(times["dense"]),
                             variant=f"{variant} (threshold, γ̄ = {fractions[variant]:.2f}, padded)", batch=b, seq_len=T,
                             dense_s=median(times["dense"]), routed_s=median(times[variant]), ratio=ratio,
                             ratio_min=min(times[variant]) / min(times["dense"]), closed=closed,
                             ideal=closed, bar=BAR_TIME * closed, passed=ratio <= BAR_TIME * closed,
                             bar_applies=False, times=times[variant], dense_times=times["dense"]))
            log(f"prefill threshold b={b} T={T} {variant}: {ratio:.3f} (closed at padded counts {closed:.3f})")
    return dict(rows=rows, profiles=profiles, profile_config=plan["prefill"][0])


# ---- 3. training step --------------------------------------------------------------------------------


def read_optimizer_config() -> Dict:
    from omegaconf import OmegaConf

    from benchmarks.common import REPO

    opt = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "stt_qwen0_5b.yaml").optimizer)
    opt.pop("_component_")
    return opt


def prepare_training(models: Dict) -> Tuple[CEWithChunkedOutputLoss, torch.optim.Optimizer]:
    """The recipe's chunked loss and the configs' AdamW over every model's parameters, models in train mode.

    Backbone parameters are shared objects (``build_like``), so one optimizer state serves all models."""
    loss_fn = CEWithChunkedOutputLoss()
    params = {}
    for m in models.values():
        m.set_num_output_chunks(loss_fn.num_output_chunks)
        m.train()
        for p in m.parameters():
            params[id(p)] = p
    return loss_fn, torch.optim.AdamW(list(params.values()), lr=1e-6, **read_optimizer_config())


def timed_train_step(model, variant: str, tokens: torch.Tensor, loss_fn, optimizer) -> Dict[str, float]:
    """One optimizer step of the recipe's loss; seconds of its forward, backward, optimizer and whole step."""
    t0 = time.perf_counter()
    loss = train_loss(model, variant, tokens, loss_fn)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return dict(fwd=t1 - t0, bwd=t2 - t1, opt=t3 - t2, step=t3 - t0)


def train_breakdown(models: Dict, tokens: torch.Tensor, loss_fn, phases: Dict, rounds: int) -> Dict:
    """Where a training step's time goes: its parts timed alone (forward + backward each), interleaved.

    Routing is every other layer, so the decoder is ``L/2`` identical pairs (layer r − 1, routed layer r);
    one pair per model is timed on the inputs that pair sees in the dense model. The LM head is the final
    norm, the tied projection and the loss; the loss alone (log-softmax over the vocabulary, no matmul
    FLOPs) is timed on the head's logits. Embedding is the lookup and its ``[V, d]`` gradient. The
    optimizer is the step's own median. ``rest`` is the measured dense step minus the parts. The ratio
    predicted from the parts (same head, embedding, optimizer and rest for every model) shows how much of
    the measured ratio the unskipped parts explain.
    """
    dense = models["dense"]
    routed_idx = routed_layers(models["mod"])[0].layer_idx
    pairs = len(dense.layers) // 2
    if any(len(routed_layers(models[v])) != pairs for v in ("mod", "stt")):
        raise RuntimeError("the breakdown assumes every other layer routed")
    captured = {}

    def capture(key):
        def hook(module, args, kwargs):
            captured[key] = args[0] if args else kwargs["x"]
        return hook

    hooks = [dense.layers[routed_idx - 1].register_forward_pre_hook(capture("pair_in"), with_kwargs=True),
             dense.norm.register_forward_pre_hook(capture("head_in"), with_kwargs=True)]
    with torch.no_grad():
        dense(tokens)
    for h in hooks:
        h.remove()
    pair_in = captured["pair_in"].detach().clone().requires_grad_()
    head_in = captured["head_in"].detach().clone().requires_grad_()
    labels = torch.hstack((tokens[..., 1:], torch.full((tokens.shape[0], 1), loss_fn.ignore_index)))

    def pair(name):
        layers = models[name].layers
        routing = RoutingContext(mode="teacher", beta_ce=1.0, beta_cu=1.0)
        out = layers[routed_idx](layers[routed_idx - 1](pair_in, routing=routing), routing=routing) \
            if name != "dense" else layers[routed_idx](layers[routed_idx - 1](pair_in))
        loss = out.sum() if name == "dense" else training_loss(out.sum(), routing, config_loss_weights(name))[0]
        loss.backward()

    def head():
        loss_fn(dense.chunked_output(dense.norm(head_in)), labels).backward()

    with torch.no_grad():
        logits = [c.detach() for c in dense.chunked_output(dense.norm(head_in))]

    def loss_only():
        loss_fn([c.requires_grad_() for c in (x.detach() for x in logits)], labels).backward()

    def embedding():
        dense.tok_embeddings(tokens).sum().backward()

    fns = {f"pair_{name}": (lambda n=name: pair(n)) for name in models}
    fns.update(head=head, loss=loss_only, embedding=embedding)
    times = interleaved(fns, rounds=rounds, warmup=1)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    med = {k: median(v) for k, v in times.items()}
    parts = dict(pairs=pairs * med["pair_dense"], lm_head_matmuls=med["head"] - med["loss"], loss=med["loss"],
                 embedding=med["embedding"], optimizer=phases["dense"]["opt"])
    parts["rest"] = phases["dense"]["step"] - sum(parts.values())
    fixed = sum(v for k, v in parts.items() if k != "pairs")
    predicted = {v: (pairs * med[f"pair_{v}"] + fixed) / phases["dense"]["step"] for v in models if v != "dense"}
    return dict(routed_layer=routed_idx, pairs=pairs, part_s=parts, pair_s={v: med[f"pair_{v}"] for v in models},
                pair_ratio={v: median(a / b for a, b in zip(times[f"pair_{v}"], times["pair_dense"])) for v in models if v != "dense"},
                predicted_step_ratio=predicted, dense_step_s=phases["dense"]["step"])


def section_train(size: str, plan: Dict, dense, profile: bool) -> Dict:
    """Training steps at each ``plan["train"]`` shape (b, T): one model per variant, sharing the backbone and
    one optimizer, timed in interleaved rounds after warm-up steps."""
    shape = cf.model_shape(size)
    models, rshapes = {"dense": dense}, {"dense": cf.RoutingShape.dense()}
    for variant in ("mod", "sdt", "stt"):
        routing = routing_for(variant, capacity=GAMMA)  # teacher top-k at γ (training)
        models[variant] = build_like(dense, variant, size, **routing)
        rshapes[variant] = shapes_for(size, variant, routing)[1]
    loss_fn, optimizer = prepare_training(models)
    rows, dense_phases, breakdowns, profiles = [], {}, {}, {}
    for b, T in plan["train"]:
        tokens = torch.randint(0, shape.vocab_size, (b, T))
        phases: Dict[str, List[Dict[str, float]]] = {name: [] for name in models}

        def step(name):
            phases[name].append(timed_train_step(models[name], name, tokens, loss_fn, optimizer))

        # Warm-up steps: lazy optimizer state, and the heap growing to the step's peak (see MALLOC_REUSE).
        warmup = plan["train_warmup"]
        interleaved({name: (lambda n=name: step(n)) for name in models}, rounds=plan["train_rounds"], warmup=warmup)
        for name in models:
            phases[name] = phases[name][warmup:]
        med = {name: {k: median(p[k] for p in phases[name]) for k in ("fwd", "bwd", "opt", "step")} for name in models}
        dense_phases[f"{b}x{T}"] = med["dense"]
        breakdowns[f"{b}x{T}"] = train_breakdown(models, tokens, loss_fn, med, rounds=plan["train_breakdown_rounds"])
        log(f"train b={b} T={T} breakdown: " + ", ".join(f"{k} {v:.2f} s" for k, v in breakdowns[f"{b}x{T}"]["part_s"].items()))
        for variant in ("mod", "sdt", "stt"):
            closed = cf.flop_ratio(shape, rshapes[variant], T, training=True)
            round_ratios = [r["step"] / d["step"] for r, d in zip(phases[variant], phases["dense"])]
            ratio = median(round_ratios)
            fb = median((r["fwd"] + r["bwd"]) / (d["fwd"] + d["bwd"]) for r, d in zip(phases[variant], phases["dense"]))
            d_fb = med["dense"]["fwd"] + med["dense"]["bwd"]
            expected_step = (closed * d_fb + med["dense"]["opt"]) / med["dense"]["step"]
            rows.append(dict(variant=variant, batch=b, seq_len=T, ratio=ratio, ratio_fwd_bwd=fb, closed=closed,
                             expected_step_with_fixed_optimizer=expected_step, bar=BAR_TIME * closed,
                             passed=ratio <= BAR_TIME * closed, passed_fwd_bwd=fb <= BAR_TIME * closed,
                             bar_applies=variant in ("mod", "sdt"), phases=med[variant], dense_phases=med["dense"],
                             round_ratios=round_ratios, round_steps=[p["step"] for p in phases[variant]],
                             dense_round_steps=[p["step"] for p in phases["dense"]]))
            log(f"train b={b} T={T} {variant}: step {ratio:.3f} fwd+bwd {fb:.3f} closed {closed:.3f} "
                f"(rounds {', '.join(f'{x:.3f}' for x in round_ratios)})")
        if profile and not profiles:
            for name in ("dense", "mod"):
                profiles[name] = profile_summary(lambda n=name: step(n), shape.vocab_size)
    for m in models.values():
        m.set_num_output_chunks(1)
        m.eval()
    del optimizer
    return dict(rows=rows, dense_phases=dense_phases, breakdowns=breakdowns, profiles=profiles)


# ---- 4. decode + 5. KV cache -----------------------------------------------------------------------------


def _cache_modules(model):
    return [layer.attn.kv_cache for layer in model.layers]


def snapshot_caches(model) -> List[Dict[str, torch.Tensor]]:
    return [{n: b.clone() for n, b in cache.named_buffers()} for cache in _cache_modules(model)]


def restore_caches(model, snapshot, batch: int, max_len: int) -> None:
    """Fresh caches for ``batch`` rows (``setup_caches``), each row a copy of the batch-1 snapshot."""
    delete_kv_caches(model)
    model.setup_caches(batch_size=batch, dtype=torch.float32, decoder_max_seq_len=max_len)
    for cache, saved in zip(_cache_modules(model), snapshot):
        selective = hasattr(cache, "reserve")
        if selective:  # starts at ⌈γ·max_len⌉ entries per row: make room for what the prompt stored
            cache.reserve(saved["k_cache"].shape[2] - 1)
        for name, buf in cache.named_buffers():
            src = saved[name]
            if selective and name in ("k_cache", "v_cache", "entry_slots"):  # entries, not the scratch slot
                entry_dim = 2 if name != "entry_slots" else 1
                src = src.narrow(entry_dim, 0, src.shape[entry_dim] - 1)
                buf = buf.narrow(entry_dim, 0, src.shape[entry_dim])
            buf.copy_(src)  # broadcasts the single row over the batch
        if selective:
            cache.sync_fill_bound()  # the copied rows' fill, as the cache's host-side bound


def kv_accounting(model, records, shape: cf.ModelShape, context: int) -> Dict:
    """Bytes held by each layer's cache: entries that hold data (per-token bytes × count) and allocated."""
    per_token = shape.kv_values_per_token * 4  # fp32
    layers = []
    for i, layer in enumerate(model.layers):
        cache = layer.attn.kv_cache
        allocated = sum(b.nbytes for b in cache.buffers())
        if hasattr(cache, "fill"):
            fill = cache.fill.tolist()
            executed = records[i].selected_mask.sum(-1).tolist()
            # A layer whose skipped tokens write K/V stores every token; otherwise exactly those that ran.
            expected = [context] * len(fill) if layer.skipped_tokens_write_kv else executed
            layers.append(dict(layer=i, routed=True, entries=fill, executed=executed,
                               occupied_bytes=sum(fill) * per_token,
                               occupied_matches_executed=fill == expected,
                               stored_bytes_match=int(cache.fill.sum()) == sum(expected),
                               allocated_bytes=allocated))
        else:
            layers.append(dict(layer=i, routed=False, entries=[cache.size] * cache.k_cache.shape[0],
                               occupied_bytes=cache.size * cache.k_cache.shape[0] * per_token,
                               allocated_bytes=allocated))
    return dict(context=context, per_token_bytes=per_token, layers=layers)


#: Routed models of the decode section: (name, variant, routing options). ``stt_kv``: context-preserving
#: attention (skipped tokens still write K/V), which keeps the dense KV cache and its reads.
DECODE_MODELS = (("mod", "mod", {}), ("stt", "stt", {}), ("stt_kv", "stt", {"skipped_tokens_write_kv": True}))


def section_decode(size: str, plan: Dict, dense) -> Dict:
    shape = cf.model_shape(size)
    models, rshapes, calibration = {"dense": dense}, {}, {}
    calib_tokens = torch.randint(0, shape.vocab_size, (1, plan["calib_seq"]))
    for name, variant, options in DECODE_MODELS:
        routing = routing_for(variant, capacity=GAMMA, student="threshold", **options)
        model = build_like(dense, variant, size, **routing)
        calibration[name] = calibrate_student_threshold(model, calib_tokens, fraction=GAMMA)
        models[name] = model
        rshapes[name] = shapes_for(size, variant, routing)[1]
        log(f"decode: calibrated {name} student bias, selected fractions on calibration text "
            f"{[round(v, 3) for v in calibration[name].values()]}")
    steps, warm = plan["decode_steps"], plan["decode_warmup"]
    rows, kv = [], []
    for context in plan["decode_ctx"]:
        max_len = context + warm + steps + 1
        prompt = torch.randint(0, shape.vocab_size, (1, context))
        snapshots, prefill_s, dense_kv = {}, {}, None
        with torch.inference_mode():
            for name, model in models.items():
                model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=max_len)
                rc = RoutingContext(mode="student")
                prefill_s[name] = timed(lambda: model(prompt, mask=causal_cache_mask(1, context, max_len),
                                                      input_pos=torch.arange(context), routing=rc))
                acc = kv_accounting(model, {**{i: r for i, r in rc.layers.items()}}, shape, context)
                if name == "dense":
                    dense_kv = acc
                else:
                    kv.append(kv_summary(name, acc, dense_kv, shape, rshapes[name]))
                snapshots[name] = snapshot_caches(model)
                log(f"decode: prefilled {name} to {context} tokens in {prefill_s[name]:.1f}s")
            for batch in plan["decode_batch"]:
                for name, model in models.items():
                    restore_caches(model, snapshots[name], batch, max_len)
                tokens = torch.randint(0, shape.vocab_size, (batch, warm + steps))
                times = {name: [] for name in models}
                traffic = {name: {"runs": {}, "entries": {}, "rows": {}} for name in models if name != "dense"}
                names = list(models)
                for i in range(warm + steps):
                    pos = context + i
                    mask = causal_cache_mask(batch, 1, max_len, offset=pos)
                    input_pos = torch.full((batch,), pos)
                    for name in names[i % len(names):] + names[: i % len(names)]:
                        model = models[name]
                        rc = RoutingContext(mode="student")
                        t = timed(lambda: model(tokens[:, i:i + 1], mask=mask, input_pos=input_pos, routing=rc))
                        if i < warm:
                            continue
                        times[name].append(t)
                        if name == "dense":
                            continue
                        for layer in routed_layers(model):
                            ran = rc.layers[layer.layer_idx].selected_mask[:, 0]
                            read = int(layer.attn.kv_cache.fill[ran].sum())  # each running row reads its entries
                            traffic[name]["runs"].setdefault(layer.layer_idx, []).append(float(ran.any()))
                            traffic[name]["rows"].setdefault(layer.layer_idx, []).append(int(ran.sum()))
                            traffic[name]["entries"].setdefault(layer.layer_idx, []).append(read)
                mean_context = context + warm + (steps + 1) / 2
                for variant in rshapes:
                    runs = {l: sum(v) / len(v) for l, v in traffic[variant]["runs"].items()}
                    entries = {l: sum(v) / len(v) for l, v in traffic[variant]["entries"].items()}
                    rows_run = {l: sum(v) / len(v) for l, v in traffic[variant]["rows"].items()}
                    flops_closed = (cf.decode_step_flops(shape, rshapes[variant], batch=batch, context=mean_context,
                                                         rows=rows_run, kv_entries=entries)
                                    / cf.decode_step_flops(shape, cf.RoutingShape.dense(), batch=batch, context=mean_context))
                    closed = cf.decode_bytes_ratio(shape, rshapes[variant], bytes_per_value=4, batch=batch,
                                                   context=mean_context, runs=runs, kv_entries=entries)
                    nominal = cf.decode_bytes_ratio(shape, rshapes[variant], bytes_per_value=4, batch=batch,
                                                    context=mean_context)
                    ratio = paired_ratio(times, variant, "dense")
                    executed = sum(sum(v) for v in traffic[variant]["runs"].values()) / max(1, sum(len(v) for v in traffic[variant]["runs"].values()))
                    rows.append(dict(variant=variant, context=context, batch=batch, dense_ms=1e3 * median(times["dense"]),
                                     routed_ms=1e3 * median(times[variant]), ratio=ratio,
                                     ratio_min=min(times[variant]) / min(times["dense"]),
                                     closed=closed["ratio"], closed_ideal=closed["ratio_ideal"],
                                     closed_nominal=nominal["ratio"], weights_read_fraction=executed,
                                     flops_closed=flops_closed,
                                     executed_fraction=sum(sum(v) for v in traffic[variant]["rows"].values())
                                     / (batch * sum(len(v) for v in traffic[variant]["rows"].values())),
                                     bar=BAR_TIME * closed["ratio"], bar_applies=batch == 1,
                                     passed=ratio <= BAR_TIME * closed["ratio"], prefill_s=prefill_s[variant],
                                     dense_prefill_s=prefill_s["dense"]))
                    log(f"decode ctx={context} b={batch} {variant}: {ratio:.3f} (closed {closed['ratio']:.3f}, "
                        f"weights read in {executed:.2f} of steps) dense {1e3 * median(times['dense']):.1f} ms")
        for model in models.values():
            delete_kv_caches(model)
    return dict(rows=rows, kv=kv, calibration=calibration, steps=steps)


def kv_summary(variant: str, acc: Dict, dense_acc: Dict, shape: cf.ModelShape, rshape: cf.RoutingShape) -> Dict:
    context = acc["context"]
    routed = [l for l in acc["layers"] if l["routed"]]
    fractions = {l["layer"]: sum(l["executed"]) / (len(l["executed"]) * context) for l in routed}
    gamma_bar = sum(fractions.values()) / len(fractions)
    occupied = sum(l["occupied_bytes"] for l in acc["layers"])
    dense_occupied = sum(l["occupied_bytes"] for l in dense_acc["layers"])
    allocated = sum(l["allocated_bytes"] for l in acc["layers"])
    dense_allocated = sum(l["allocated_bytes"] for l in dense_acc["layers"])
    closed = cf.kv_cache_ratio(shape, rshape, fractions)
    exact = all(l["occupied_matches_executed"] for l in routed)
    uniform = 1.0 if rshape.skipped_tokens_write_kv else (1 + gamma_bar) / 2
    return dict(variant=variant, context=context, gamma_bar=gamma_bar, closed_uniform=uniform,
                closed=closed, occupied_ratio=occupied / dense_occupied, allocated_ratio=allocated / dense_allocated,
                per_layer_entries_equal_executed=exact,
                passed=exact and abs(occupied / dense_occupied - closed) < 1e-9,
                routed_layer_allocated_bytes=routed[0]["allocated_bytes"],
                routed_layer_occupied_bytes=routed[0]["occupied_bytes"],
                dense_layer_allocated_bytes=dense_acc["layers"][routed[0]["layer"]]["allocated_bytes"])


# ---- 6. routing overhead ------------------------------------------------------------------------------


def layer_input(dense, tokens: torch.Tensor) -> torch.Tensor:
    """Realistic hidden states entering layer 1: embedding → layer 0 of the (shared) backbone."""
    return dense.layers[0](dense.tok_embeddings(tokens))


def section_overhead(size: str, plan: Dict, dense) -> Dict:
    shape = cf.model_shape(size)
    T = plan["overhead_seq"]
    rows = []
    for variant in ("mod", "sdt", "stt"):
        for mode, batch in (("topk", 1), ("threshold", plan["overhead_ragged_batch"])):
            routing = routing_for(variant, capacity=GAMMA, student=mode)
            model = build_like(dense, variant, size, **routing)
            with torch.inference_mode():
                if mode == "threshold":  # calibrated on one sequence; the batch below is then ragged
                    calibrate_student_threshold(model, torch.randint(0, shape.vocab_size, (1, plan["calib_seq"])), GAMMA)
                tokens = torch.randint(0, shape.vocab_size, (batch, T))
                x = layer_input(dense, tokens)
                layer = model.layers[1]
                dense_layer = dense.layers[1]
                positions = token_positions(None, batch, T, 0, x.device)
                starts = sequence_starts(positions, None, 0)
                logits = layer.student_logits(x, starts, None)
                selection = layer.student_selection(logits, starts, None, single_sequence=True)
                gate = layer.student_gate(x)
                k = selection.num_selected
                update = torch.randn(batch, k, shape.embed_dim)
                query_index = selection.positions

                def router():
                    layer.student_logits(x, starts, None)
                    layer.student_gate(x)

                def mask_building():
                    if selection.valid is not None:  # ragged (threshold, batch > 1): explicit mask
                        _attention_mask(None, query_index, query_index, query_index, selection.valid)

                fns = {
                    "dense_layer": lambda: dense_layer(x),
                    "routed_layer": lambda: layer(x),
                    "block_on_k_tokens": lambda: dense_layer(x[:, :k]),
                    "router": router,
                    "selection": lambda: layer.student_selection(logits, starts, None, single_sequence=True),
                    "gather": lambda: (gather_tokens(x, query_index), gather_tokens(positions, query_index)),
                    "scatter+gate": lambda: scatter_updates(
                        x, selection, update if gate is None else update * gather_tokens(gate, query_index)[..., None]),
                    "mask_building": mask_building,
                }
                times = interleaved(fns, rounds=plan["overhead_rounds"], warmup=1)
            med = {name: median(v) for name, v in times.items()}
            parts = ("router", "selection", "gather", "scatter+gate", "mask_building")
            overhead = sum(med[p] for p in parts)
            share = overhead / med["dense_layer"]
            rows.append(dict(variant=variant, mode=mode, batch=batch, seq_len=T, selected=k,
                             ragged=selection.valid is not None, ms={n: 1e3 * v for n, v in med.items()},
                             share=share, share_by_part={p: med[p] / med["dense_layer"] for p in parts},
                             residual_share=(med["routed_layer"] - med["block_on_k_tokens"]) / med["dense_layer"],
                             layer_ratio=med["routed_layer"] / med["dense_layer"],
                             passed=share <= BAR_OVERHEAD))
            log(f"overhead {variant} {mode} b={batch}: {100 * share:.2f}% of a dense layer "
                f"(routed layer {med['routed_layer'] / med['dense_layer']:.3f}× dense layer)")
    return dict(rows=rows)


# ---- 7. naive alternative -------------------------------------------------------------------------------


def naive_layer_forward(layer, x, *, mask=None, input_pos=None, routing=None, **kwargs):
    """The naive alternative: same student decision and gate, but the block runs densely on every token and
    the update is masked afterwards (skipped tokens still cost full compute and are keys/values)."""
    batch, seq_len, _ = x.shape
    starts = sequence_starts(token_positions(input_pos, batch, seq_len, 0, x.device), mask, 0)
    selection = layer.student_selection(layer.student_logits(x, starts, None), starts, None, single_sequence=True, analysis=True)
    gate = layer.student_gate(x)
    update = TransformerSelfAttentionLayer.forward(layer, x, mask=mask, input_pos=input_pos) - x
    if gate is not None:
        update = update * gate[..., None]
    return x + update * selection.mask[..., None].to(x.dtype)


def section_naive(size: str, plan: Dict, dense) -> Dict:
    shape = cf.model_shape(size)
    T = plan["naive_seq"]
    rows = []
    with torch.inference_mode():
        x = layer_input(dense, torch.randint(0, shape.vocab_size, (1, T)))
        for variant in ("mod", "stt"):
            model = build_like(dense, variant, size, **routing_for(variant, capacity=GAMMA, student="topk"))
            layer = model.layers[1]
            times = interleaved({"dense": lambda: dense.layers[1](x), "routed": lambda: layer(x),
                                 "naive": lambda: naive_layer_forward(layer, x)},
                                rounds=plan["overhead_rounds"], warmup=1)
            rows.append(dict(level="layer", variant=variant, batch=1, seq_len=T,
                             routed_vs_dense=paired_ratio(times, "routed", "dense"),
                             naive_vs_dense=paired_ratio(times, "naive", "dense"),
                             naive_vs_routed=paired_ratio(times, "naive", "routed")))
            log(f"naive layer {variant}: ours {rows[-1]['routed_vs_dense']:.3f}× dense, naive {rows[-1]['naive_vs_dense']:.3f}×")
        if plan.get("naive_model"):
            b, Tm = plan["naive_model"]
            routing = routing_for("mod", capacity=GAMMA, student="topk")
            ours = build_like(dense, "mod", size, **routing)
            naive = build_like(dense, "mod", size, **routing)
            for layer in routed_layers(naive):  # instance-level override: this model only
                layer.forward = (lambda l: (lambda x, **kw: naive_layer_forward(l, x, **kw)))(layer)
            naive.load_state_dict(ours.state_dict())
            tokens = torch.randint(0, shape.vocab_size, (b, Tm))
            times = interleaved({"dense": lambda: dense(tokens), "routed": lambda: ours(tokens),
                                 "naive": lambda: naive(tokens)}, rounds=plan["naive_rounds"], warmup=1)
            rows.append(dict(level="model", variant="mod", batch=b, seq_len=Tm,
                             routed_vs_dense=paired_ratio(times, "routed", "dense"),
                             naive_vs_dense=paired_ratio(times, "naive", "dense"),
                             naive_vs_routed=paired_ratio(times, "naive", "routed")))
            log(f"naive model mod: ours {rows[-1]['routed_vs_dense']:.3f}× dense, naive {rows[-1]['naive_vs_dense']:.3f}×")
    return dict(rows=rows)


# ---- report -------------------------------------------------------------------------------------------


def _pf(ok) -> str:
    return "pass" if ok else "**FAIL**"


def _table(headers: List[str], rows: List[List]) -> List[str]:
    """A Markdown (GitHub pipe) table as lines. Cells are formatted by the caller; ``disable_numparse`` keeps
    tabulate from re-formatting numbers that are already strings (``"0.8000"`` would become ``0.8``)."""
    from tabulate import tabulate  # imported here: ``benchmarks.gpu`` reuses this module on machines without it

    return tabulate(rows, headers, tablefmt="github", disable_numparse=True).splitlines() + [""]


def _cpu_model() -> str:
    """The CPU's marketing name (Linux ``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_device() -> Dict:
    """What this process measures on: every model here is built and timed on the CPU, with the intra-op
    thread count in force now; CUDA devices are listed only to say whether GPU numbers could have been taken."""
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return dict(cpu=_cpu_model(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                threads=torch.get_num_threads(), logical_cpus=os.cpu_count(), cuda=cuda)


def _device_text(device: Dict) -> str:
    return (f"CPU {device['cpu']} ({device['cpu_capability']}), {device['threads']} thread(s) of "
            f"{device['logical_cpus']} logical CPUs")


def _gpu_status(device) -> Tuple[str, str]:
    """(status, explanation) of the GPU numbers, from the device a run recorded (``None``: results written
    before runs recorded their device)."""
    if device is None:
        return "not recorded", "these results predate the device record; every number above is CPU (fp32)"
    if not device["cuda"]:
        return "pending", "the machine that ran this had no CUDA device; every number above is CPU (fp32)"
    return "not measured", (f"CUDA device(s) {', '.join(device['cuda'])} present, but this suite builds and times "
                            "its models on the CPU only; every number above is CPU (fp32)")


def render_markdown(results: Dict) -> str:
    meta = results["meta"]
    device = meta.get("device")
    measured_on = (_device_text(device) if device
                   else f"CPU (model not recorded), {meta['threads']} thread(s) of {meta['cpus']} logical CPUs")
    out = [f"Shape `{meta['size']}`, fp32 on {measured_on}, torch {meta['torch']}, "
           f"{'quick' if meta['quick'] else 'full'} plan. Sections and the commands that produced them:", ""]
    for name in SECTIONS:
        if name in results:
            r = results[name]
            denormals = "subnormals flushed to zero" if r.get("flush_denormal") else "subnormals kept"
            if r.get("device") == device:
                elsewhere = ""
            else:  # merged from an earlier run on another machine, or from before runs recorded their device
                elsewhere = f", on {_device_text(r['device'])}" if r.get("device") else ", device not recorded"
            out.append(f"- {name}: `{r['command']}` ({r['elapsed_s']:.0f} s, load average at end {r['loadavg_end'][0]:.1f}, "
                       f"{denormals}{elsewhere})")
    out += ["", "### Summary of the bars", ""] + render_summary(results)
    if "flops" in results:
        r = results["flops"]
        out += [f"### 1. FLOPs per forward (FlopCounterMode, b = 1, T = {r['seq_len']}, student top-k)", ""]
        out += _table(
            ["variant", "γ", "measured total ratio", "closed form (ideal + routers)", "ideal (no routers)", "routers share",
             "attention measured / closed", "decoder linear measured / closed", "bar"],
            [[row["variant"], row["gamma"], f"{row['ratio_total']:.4f}", f"{row['closed_ratio_total']:.4f}",
              f"{row['closed_ideal_total']:.4f}", f"{100 * row['routers_share']:.2f} %",
              f"{row['ratio_attention']:.4f} / {row['closed_ratio_attention']:.4f}",
              f"{row['ratio_block_linear']:.4f} / {row['closed_ratio_block_linear']:.4f}", _pf(row["passed"])]
             for row in r["rows"][1:]])
        t = r["train"]
        out += [f"Training forward + backward FLOPs (teacher mode, b = {t['batch']}, T = {t['seq_len']}):", ""]
        out += _table(
            ["variant", "measured", "closed form", "routed/dense measured", "closed ratio", "bar"],
            [[row["variant"], cf.fmt_flops(row["measured"]), cf.fmt_flops(row["closed"]), f"{row['ratio']:.4f}",
              f"{row['closed_ratio']:.4f}", _pf(row["passed"])] for row in t["rows"]])
    if "prefill" in results:
        r = results["prefill"]
        out += ["### 2. Prefill wall-clock (student top-k, γ = 0.5, no cache, inference_mode)", ""]
        out += _table(
            ["variant", "b", "T", "rounds", "dense s", "routed s", "routed/dense", "ratio of medians", "ratio of minima",
             "FLOP ratio closed form", "bar ≤ 1.05×", "result"],
            [[row["variant"], row["batch"], row["seq_len"], len(row["times"]), f"{row['dense_s']:.2f}",
              f"{row['routed_s']:.2f}", f"{row['ratio']:.3f}", f"{row['ratio_of_medians']:.3f}", f"{row['ratio_min']:.3f}",
              f"{row['closed']:.3f}", f"{row['bar']:.3f}",
              _pf(row["passed"]) if row["bar_applies"] else f"reported ({'within' if row['passed'] else 'above'})"]
             for row in r["rows"]])
        out += _render_profiles(r.get("profiles"), f"prefill b, T = {r['profile_config']}")
    if "train" in results:
        r = results["train"]
        out += ["### 3. Training step (teacher mode, fwd + bwd + AdamW, γ = 0.5)", ""]
        for bt, d in r["dense_phases"].items():
            out.append(f"Dense step at b × T = {bt}: {d['step']:.2f} s = fwd {d['fwd']:.2f} + bwd {d['bwd']:.2f} + "
                       f"optimizer {d['opt']:.2f}.")
        out += [""]
        out += _table(
            ["variant", "b", "T", "step ratio", "fwd+bwd ratio", "training FLOP ratio (closed)", "bar ≤ 1.05×",
             "step (fwd+bwd) result", "step if optimizer fixed, fwd+bwd ideal"],
            [[row["variant"], row["batch"], row["seq_len"], f"{row['ratio']:.3f}", f"{row['ratio_fwd_bwd']:.3f}",
              f"{row['closed']:.3f}", f"{row['bar']:.3f}",
              f"{_pf(row['passed'])} ({_pf(row['passed_fwd_bwd'])})" if row["bar_applies"]
              else f"reported ({'within' if row['passed'] else 'above'} 1.05×)",
              f"{row['expected_step_with_fixed_optimizer']:.3f}"] for row in r["rows"]])
        out += _render_breakdowns(r.get("breakdowns", {}))
        out += _render_profiles(r.get("profiles"), "one training step")
    if "decode" in results:
        r = results["decode"]
        out += [f"### 4. Decode per token (selective KV cache, threshold student calibrated to ≈ 50 %, median of {r['steps']} steps)", ""]
        out += _table(
            ["variant", "context", "b", "dense ms", "routed ms", "routed/dense", "(min)",
             "bytes ratio closed form (measured decisions)", "nominal γ = 0.5", "γ̄ executed", "weights read in",
             "FLOP ratio closed form", "bar ≤ 1.05× bytes (b = 1)", "result"],
            [[row["variant"], row["context"], row["batch"], f"{row['dense_ms']:.1f}", f"{row['routed_ms']:.1f}",
              f"{row['ratio']:.3f}", f"{row['ratio_min']:.3f}", f"{row['closed']:.3f}", f"{row['closed_nominal']:.3f}",
              f"{row['executed_fraction']:.2f}", f"{100 * row['weights_read_fraction']:.0f} % of steps",
              f"{row['flops_closed']:.3f}", f"{row['bar']:.3f}",
              _pf(row["passed"]) if row["bar_applies"] else f"reported ({'within' if row['passed'] else 'above'})"]
             for row in r["rows"]])
        out += ["### 5. KV cache after prefill (batch 1)", ""]
        out += _table(
            ["variant", "context", "γ̄ (measured executed fraction)", "entries per routed layer = executed tokens",
             "occupied bytes routed/dense", "closed form (1+γ̄)/2 (per-layer γ̄)", "allocated bytes routed/dense", "result"],
            [[row["variant"], row["context"], f"{row['gamma_bar']:.3f}", row["per_layer_entries_equal_executed"],
              f"{row['occupied_ratio']:.4f}", f"{row['closed_uniform']:.4f} ({row['closed']:.4f})",
              f"{row['allocated_ratio']:.4f}",
              f"{_pf(row['passed'])} (occupied); allocated: {'saves' if row['allocated_ratio'] < 0.99 else 'no saving'}"]
             for row in r["kv"]])
    if "overhead" in results:
        r = results["overhead"]
        out += ["### 6. Routing overhead vs one dense layer (layer 1, γ = 0.5)", ""]
        out += _table(
            ["variant", "student", "b", "T", "router", "selection", "gather", "scatter+gate", "mask", "total share",
             "bar ≤ 5 %", "routed layer / dense layer", "(routed − block on k)/dense"],
            [[row["variant"], f"{row['mode']}{' (ragged)' if row['ragged'] else ''}", row["batch"], row["seq_len"],
              *(f"{100 * row['share_by_part'][part]:.2f} %"
                for part in ("router", "selection", "gather", "scatter+gate", "mask_building")),
              f"{100 * row['share']:.2f} %", _pf(row["passed"]), f"{row['layer_ratio']:.3f}",
              f"{100 * row['residual_share']:.1f} %"] for row in r["rows"]])
    if "naive" in results:
        r = results["naive"]
        out += ["### 7. Naive alternative (dense block on every token, then mask) vs ours", ""]
        out += _table(
            ["level", "variant", "b", "T", "ours / dense", "naive / dense", "naive / ours"],
            [[row["level"], row["variant"], row["batch"], row["seq_len"], f"{row['routed_vs_dense']:.3f}",
              f"{row['naive_vs_dense']:.3f}", f"{row['naive_vs_routed']:.3f}"] for row in r["rows"]])
    out += ["### 8. GPU", "", "GPU numbers {}: {}.".format(*_gpu_status(device)), ""]
    return "\n".join(out)


def render_summary(results: Dict) -> List[str]:
    """One row per bar of issue #4: measured ratio, closed form, bar, result."""
    rows = []
    if "flops" in results:
        flops = results["flops"]["rows"][1:]
        worst = max(flops, key=lambda r: abs(r["ratio_total"] - r["closed_ratio_total"]) / r["closed_ratio_total"])
        rows.append([1, "FLOPs within 2 % of closed form (+ routers)",
                     f"{len(flops)} variant × γ, worst: {worst['variant']} γ = {worst['gamma']}",
                     f"{worst['ratio_total']:.4f}", f"{worst['closed_ratio_total']:.4f}", "± 2 %",
                     _pf(all(r["passed"] for r in flops))])
    if "prefill" in results:
        for row in results["prefill"]["rows"]:
            if row.get("bar_applies", True):
                rows.append([2, "prefill ≤ 1.05 × FLOP ratio", f"{row['variant']} b = {row['batch']} T = {row['seq_len']}",
                             f"{row['ratio']:.3f}", f"{row['closed']:.3f}", f"≤ {row['bar']:.3f}", _pf(row["passed"])])
    if "train" in results:
        for row in results["train"]["rows"]:
            label = "train step ≤ 1.05 × FLOP ratio" if row["bar_applies"] else "train step (own closed form, reported)"
            res = _pf(row["passed"]) if row["bar_applies"] else ("within" if row["passed"] else "above")
            rows.append([3, label, f"{row['variant']} b = {row['batch']} T = {row['seq_len']}",
                         f"{row['ratio']:.3f} (fwd+bwd {row['ratio_fwd_bwd']:.3f})", f"{row['closed']:.3f}",
                         f"≤ {row['bar']:.3f}", res])
    if "decode" in results:
        for row in results["decode"]["rows"]:
            if row["bar_applies"]:
                rows.append([4, "decode ≤ 1.05 × bytes ratio (b = 1)", f"{row['variant']} context {row['context']}",
                             f"{row['ratio']:.3f}", f"{row['closed']:.3f}", f"≤ {row['bar']:.3f}", _pf(row["passed"])])
        for row in results["decode"]["kv"]:
            rows.append([5, "KV bytes = executed × per-token; routed/dense = (1+γ̄)/2",
                         f"{row['variant']} context {row['context']}, γ̄ = {row['gamma_bar']:.3f}",
                         f"{row['occupied_ratio']:.4f} (allocated {row['allocated_ratio']:.4f})", f"{row['closed']:.4f}",
                         "exact", f"{_pf(row['passed'])} (occupied)"])
    if "overhead" in results:
        for row in results["overhead"]["rows"]:
            rows.append([6, "routing overhead ≤ 5 % of a dense layer",
                         f"{row['variant']} {row['mode']} b = {row['batch']} T = {row['seq_len']}",
                         f"{100 * row['share']:.2f} %", "–", "≤ 5 %", _pf(row["passed"])])
    if "naive" in results:
        for row in results["naive"]["rows"]:
            rows.append([7, "naive (dense then mask) vs ours",
                         f"{row['level']} {row['variant']} b = {row['batch']} T = {row['seq_len']}",
                         f"naive {row['naive_vs_dense']:.3f}× dense, ours {row['routed_vs_dense']:.3f}×", "–", "–",
                         f"ours {row['naive_vs_routed']:.2f}× faster"])
    rows.append([8, "GPU", "–", _gpu_status(results["meta"].get("device"))[0], "–", "–", "–"])
    return _table(["#", "bar", "configuration", "measured", "closed form", "bar", "result"], rows)


_PART_LABELS = dict(pairs="decoder layers (pairs × one pair)", lm_head_matmuls="LM head matmuls (norm, tied projection)",
                    loss="loss: log-softmax over V (no matmul FLOPs)", embedding="embedding lookup + [V, d] gradient",
                    optimizer="optimizer (fused AdamW, all parameters)", rest="rest (step − parts)")


def _render_breakdowns(breakdowns: Dict) -> List[str]:
    """Per training shape: the dense step's parts (each timed alone) and the ratio they predict."""
    out = []
    for bt, bd in breakdowns.items():
        variants = list(bd["predicted_step_ratio"])
        out += [f"Where the time goes, b × T = {bt} (parts timed alone, fwd + bwd, median of interleaved rounds; "
                f"one pair = layers {bd['routed_layer'] - 1}–{bd['routed_layer']}, × {bd['pairs']} pairs):", ""]
        rows = [[_PART_LABELS[part], f"{sec:.2f}", f"{100 * sec / bd['dense_step_s']:.1f} %",
                 *(f"{bd['pairs'] * bd['pair_s'][v]:.2f}" if part == "pairs" else "same" for v in variants)]
                for part, sec in bd["part_s"].items()]
        rows.append(["one pair routed/dense", "", "", *(f"{bd['pair_ratio'][v]:.3f}" for v in variants)])
        rows.append(["step ratio predicted by the parts", "", "",
                     *(f"{bd['predicted_step_ratio'][v]:.3f}" for v in variants)])
        out += _table(["part", "dense s", "share of dense step", *(f"{v} s" for v in variants)], rows)
    return out


def _render_profiles(profiles, what: str) -> List[str]:
    if not profiles:
        return []
    names = list(profiles)
    groups = sorted({g for p in profiles.values() for g in p["groups_ms"]})
    return [f"Profile ({what}; torch.profiler self CPU ms by op group):", ""] + _table(
        ["op group", *names], [[g, *(f"{profiles[n]['groups_ms'].get(g, 0.0):.0f}" for n in names)] for g in groups])


def main(argv=None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", default=[], help=f"any of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--size", default="0_5b", choices=sorted(PLANS))
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: on the shared 2-core box a second OpenMP thread stalls on "
                             "every parallel region whenever another process holds a core; see benchmarks/README.md)")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="compute with subnormal floats (default: flush them to zero, see benchmarks/README.md: with random weights "
                             "the softmax over 151,936 classes makes subnormal probabilities and gradients, which the CPU "
                             "processes up to 3× slower, by an amount that depends on each model's logits)")
    parser.add_argument("--no-profile", action="store_true", help="skip torch.profiler summaries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="discard earlier results in --out instead of merging")
    parser.add_argument("--out", default=None, help="directory for results.json / results.md "
                                                    "(default benchmarks/results/<size>[_quick])")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in (*SECTIONS, "all")]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)} or all")
    sections = [s for s in SECTIONS if not args.sections or "all" in args.sections or s in args.sections]
    set_threads(args.threads)
    with subnormals_flushed(not args.keep_denormals) as flush_denormal:
        return _run(args, argv, sections, flush_denormal)


def _run(args, argv, sections: List[str], flush_denormal: bool) -> Dict:
    """The sections of one invocation of :func:`main`, under its thread and floating-point settings."""
    torch.manual_seed(args.seed)
    plan = plan_for(args.size, args.quick)
    command = ("python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    out_dir = None
    results: Dict = {}
    if args.out != "-":
        out_dir = Path(args.out) if args.out else Path(__file__).parent / "results" / (args.size + ("_quick" if args.quick else ""))
        out_dir.mkdir(parents=True, exist_ok=True)
        previous = out_dir / "results.json"
        if previous.exists() and not args.fresh:
            # Sections run now replace their earlier results; the others are kept (each section is
            # self-contained: its routed/dense ratios always come from one process).
            old = json.loads(previous.read_text())
            same = {k: old.get("meta", {}).get(k) for k in ("size", "quick", "threads")} == dict(
                size=args.size, quick=args.quick, threads=args.threads)
            if same:
                results = old
    runs = results.setdefault("meta", {}).get("runs", [])
    profile = not args.no_profile
    run = dict(command=command, sections=sections, started=time.strftime("%Y-%m-%d %H:%M:%S"),
               loadavg_start=os.getloadavg())
    log(f"building dense {args.size} ({args.threads} threads); sections: {', '.join(sections)}")
    dense = build_dense(args.size, seed=args.seed)
    runners = dict(flops=lambda: section_flops(args.size, plan, dense),
                   prefill=lambda: section_prefill(args.size, plan, dense, profile),
                   train=lambda: section_train(args.size, plan, dense, profile),
                   decode=lambda: section_decode(args.size, plan, dense),
                   overhead=lambda: section_overhead(args.size, plan, dense),
                   naive=lambda: section_naive(args.size, plan, dense))
    device = describe_device()  # after set_threads: the thread count the sections run with
    run["device"] = device
    for section in sections:
        t0 = time.perf_counter()
        torch.manual_seed(args.seed + 1)
        results[section] = runners[section]()
        results[section]["elapsed_s"] = time.perf_counter() - t0
        results[section]["command"] = command
        results[section]["flush_denormal"] = flush_denormal
        results[section]["loadavg_end"] = os.getloadavg()
        results[section]["device"] = device
        log(f"{section} done in {results[section]['elapsed_s']:.0f}s")
        run["loadavg_end"] = os.getloadavg()
        results["meta"] = dict(size=args.size, quick=args.quick, threads=args.threads, torch=torch.__version__,
                               cpus=os.cpu_count(), device=device, plan=plan, runs=[*runs, run],
                               routing={v: config_routing(v) for v in ("mod", "sdt", "stt")})
        if out_dir is not None:  # saved after every section, so a killed run keeps what it measured
            (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
            (out_dir / "results.md").write_text(render_markdown(results))
    if out_dir is not None:
        log(f"wrote {out_dir}/results.json and results.md")
    markdown = render_markdown(results)
    print(markdown)
    return results


if __name__ == "__main__":
    main()
