"""GPU check and timings of the routed models (MoD / SDT / STT) against dense Qwen2.5, in one short run.

    python -m benchmarks.gpu                                        # Qwen2.5-0.5B shape on CUDA (a few minutes on an H200)
    python -m benchmarks.gpu --size tiny --device cpu --out /tmp/x  # smoke run of the same code (about a minute)

1. Correctness of the device path; each check prints PASS/FAIL, and any FAIL makes the exit code 1.
   a. fp32: the student forward (top-k and calibrated threshold students) on the device against the same model
      on the CPU;
   b. fp32 and bf16: a prompt prefill, then decoding one token at a time with the selective KV cache
      (``setup_caches``) reproduces the full-sequence student forward (as ``tests/test_selective_cache.py``),
      and every routed layer's cache holds exactly the tokens that ran;
   c. bf16: after ``calibrate_student_threshold`` the threshold students run about γ = 0.5 of the tokens, on the
      calibration text and on fresh text, top-k students run exactly floor(γT), and neither picks by position.
   Logits are compared as max |a − b| / max |b| (fp32 < 1e-3, bf16 < 5e-2). Where the two runs decide a token
   differently (a near-tie of the router, not an error if rare: at most 0.5 % of the decisions in fp32, 5 % in
   bf16), only the positions before a row's first differing decision are compared: causal layers make them
   independent of it ("compared" is the share of positions that were).
2. Timings in bf16 (parameters bf16, as the recipe builds them; RoPE tables stay fp32), γ = 0.5 on every other
   layer, models sharing one backbone (``common.build_like``): prefill (student top-k, ``inference_mode``), one
   training step (teacher mode, the recipe's chunked loss and auxiliary losses, backward, fused AdamW) and
   decode (threshold students calibrated to ≈ 0.5, prompt prefill then one token per step with the selective
   cache, batch 8). Every timed call ends with ``torch.cuda.synchronize()`` and is timed by ``perf_counter``;
   models run in interleaved rounds after warm-up (``common.interleaved``), and the ratio reported is the median
   of the per-round routed/dense ratios, next to the closed form (``closed_form.py``) for the shape. A section
   that fails is recorded and the others still run.
3. ``OUT/results.json`` and ``OUT/results.md`` (device, torch version, command, dtype); the Markdown is printed.
4. ``compiled``: the same models compiled (``benchmarks.compiled``, ``COMPILED_ARGS``): prefill, decode with one
   compiled step per model over static caches (CUDA graphs) at b 8 and b 32, a training step; ``OUT/compiled/``.
"""

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torchtune.modules.common_utils import delete_kv_caches

from torchtune_dtf import closed_form as cf
from benchmarks import compiled as compiled_benchmark
from benchmarks.common import (build_dense, build_like, calibrate_student_threshold, cast_params, causal_cache_mask,
                               interleaved, median, paired_ratio, results_dir, routed_layers, routing_for, shapes_for,
                               sync)
from benchmarks.run import describe_device, prepare_training, train_loss
from torchtune_dtf.modules import RoutingContext

VARIANTS = ("mod", "sdt", "stt")
SECTIONS = ("checks", "prefill", "decode", "profile", "train", "compiled")
#: ``compiled``: ``benchmarks.compiled`` on the device, compiled only (the sections above are the eager rows):
#: prefill, top-k decode at b 8 and b 32 (one compiled step with CUDA graphs), a training step; written to
#: OUT/compiled/. The issue-47 targets: prefill b8 × 2048 ≤ FLOPs + 0.05, decode b8 / b32 < 1.0, train ≤ FLOPs + 0.05.
COMPILED_ARGS = {
    "0_5b": ["--shape", "0_5b", "--dtype", "bf16", "--modes", "compiled", "--workloads", "prefill", "decode_topk", "train",
             "--rounds", "3", "--prefill-batch", "8", "--prefill-len", "2048", "--context-b8", "1024",
             "--decode-batches", "8", "32", "--decode-steps", "64", "--train-batch", "4", "--train-len", "2048"],
    "tiny": ["--shape", "tiny", "--quick", "--modes", "compiled", "--workloads", "prefill", "decode_topk", "train"],
}
GAMMA = 0.5
TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}  # max |a − b| / max |b| of logits
MAX_FLIPS = {torch.float32: 0.005, torch.bfloat16: 0.05}  # share of routing decisions two runs may decide apart (near-ties)
PLANS = {
    "0_5b": dict(check=(2, 256), check_prompt=224, calib_seq=512, fresh=(4, 1024), prefill=[(8, 2048), (1, 2048)],
                 train=[(4, 2048)], decode=(8, 1024, 128), warmup=2, rounds=5, decode_rounds=3, budget_s=45),
    "tiny": dict(check=(2, 48), check_prompt=32, calib_seq=256, fresh=(4, 128), prefill=[(2, 64)],
                 train=[(2, 64)], decode=(4, 48, 8), warmup=1, rounds=2, decode_rounds=2, budget_s=20),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def synced(fn: Callable, device: torch.device) -> Callable:
    def run():
        fn()
        sync(device)
    return run


# ---- 1. correctness ------------------------------------------------------------------------------------


def student_forward(model, tokens, **kw):
    rc = RoutingContext(mode="student")
    logits = model(tokens, routing=rc, **kw)
    return logits, {i: r.selected_mask for i, r in rc.layers.items()}


def compare(ref, got) -> Dict:
    """(logits, masks) of two runs: differing decisions, and the logits' relative error before each row's
    first differing decision (all positions when the runs decide alike)."""
    (ref_logits, ref_masks), (logits, masks) = ref, got
    diff = torch.stack([ref_masks[i].cpu() != masks[i].cpu() for i in ref_masks]).any(0)  # [b, T]
    T = diff.shape[1]
    first = torch.where(diff.any(1), diff.float().argmax(1), torch.full((diff.shape[0],), T))
    ref_logits, logits = ref_logits.float().cpu(), logits.float().cpu()
    err = max(((ref_logits[r, :n] - logits[r, :n]).abs().max().item() if n else 0.0) for r, n in enumerate(first.tolist()))
    decisions = sum(m.numel() for m in ref_masks.values())
    flips = sum(int((ref_masks[i].cpu() != masks[i].cpu()).sum()) for i in ref_masks)
    return dict(rel_err=err / ref_logits.abs().max().item(), flips=flips, decisions=decisions,
                compared=int(first.sum()) / first.numel() / T)


def decode_incrementally(model, tokens, prompt_len: int, dtype):
    """Prompt prefill, then one token at a time with the selective KV cache (as tests/test_selective_cache.py)."""
    batch, total = tokens.shape
    device = tokens.device
    with torch.device(device):
        model.setup_caches(batch_size=batch, dtype=dtype, decoder_max_seq_len=total)
    masks = causal_cache_mask(batch, total, total, device=device)
    logits, executed = student_forward(model, tokens[:, :prompt_len], mask=masks[:, :prompt_len],
                                       input_pos=torch.arange(prompt_len, device=device))
    logits, executed = [logits], {i: [m] for i, m in executed.items()}
    for t in range(prompt_len, total):
        step, ran = student_forward(model, tokens[:, t:t + 1], mask=masks[:, t:t + 1],
                                    input_pos=torch.full((batch,), t, device=device))
        logits.append(step)
        for i, m in ran.items():
            executed[i].append(m)
    executed = {i: torch.cat(m, dim=1) for i, m in executed.items()}
    fills = {layer.layer_idx: layer.attn.kv_cache.fill.tolist() for layer in routed_layers(model)}
    delete_kv_caches(model)
    return torch.cat(logits, dim=1), executed, fills


class Checks:
    def __init__(self):
        self.rows: List[Dict] = []

    def record(self, name: str, fn: Callable[[], Dict]) -> None:
        try:
            values = fn()
        except Exception as e:  # a crash is a failed check
            values = dict(passed=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        self.rows.append(dict(check=name, **values))
        shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in values.items() if k not in ("passed", "traceback")}
        print(f"[{'PASS' if values['passed'] else 'FAIL'}] {name}: {shown}", flush=True)

    @property
    def passed(self) -> bool:
        return all(r["passed"] for r in self.rows)


def compared_ok(c: Dict, dtype) -> Dict:
    return dict(c, passed=c["rel_err"] < TOL[dtype] and c["flips"] <= MAX_FLIPS[dtype] * c["decisions"])


def check_decode(model, tokens, prompt_len: int, dtype) -> Dict:
    with torch.inference_mode():
        full = student_forward(model, tokens)
        logits, executed, fills = decode_incrementally(model, tokens, prompt_len, dtype)
    c = compare(full, (logits, executed))
    fills_exact = all(fills[i] == executed[i].sum(-1).tolist() for i in fills)
    skips = all(0 < int(m.sum()) < m.numel() for m in executed.values())
    c = compared_ok(c, dtype)
    return dict(c, cache_holds_executed=fills_exact, routed_layers_skip=skips,
                passed=c["passed"] and fills_exact and skips)


def position_share(masks: Dict[int, torch.Tensor]) -> float:
    """Share of the selected tokens that lie in the first half of their sequence (≈ 0.5 unless position-ordered)."""
    T = next(iter(masks.values())).shape[1]
    return sum(int(m[:, :T // 2].sum()) for m in masks.values()) / max(1, sum(int(m.sum()) for m in masks.values()))


def check_threshold_bf16(model, calib, fresh) -> Dict:
    with torch.inference_mode():
        calibrated = calibrate_student_threshold(model, calib, GAMMA)
        _, masks = student_forward(model, fresh)
    fresh_frac = {i: m.float().mean().item() for i, m in masks.items()}
    share = position_share(masks)
    mean_c, mean_f = sum(calibrated.values()) / len(calibrated), sum(fresh_frac.values()) / len(fresh_frac)
    return dict(calibrated_mean=mean_c, calibrated_worst=max(calibrated.values(), key=lambda f: abs(f - GAMMA)),
                fresh_mean=mean_f, first_half_share=share, calibrated=calibrated, fresh=fresh_frac,
                passed=abs(mean_c - GAMMA) <= 0.05 and all(abs(f - GAMMA) <= 0.1 for f in calibrated.values())
                and abs(mean_f - GAMMA) <= 0.1 and 0.1 <= share <= 0.9)


def check_topk_bf16(model, fresh) -> Dict:
    with torch.inference_mode():
        _, masks = student_forward(model, fresh)
    k = cf.num_selected(GAMMA, fresh.shape[1])
    exact = all(m.sum(-1).tolist() == [k] * fresh.shape[0] for m in masks.values())
    share = position_share(masks)
    return dict(exact_k=exact, first_half_share=share, passed=exact and 0.1 <= share <= 0.9)


def run_checks(checks: Checks, size, plan, dense, topk, thresh, device, gen) -> None:
    """Checks a (fp32, device vs CPU), b (fp32 and bf16) and c (bf16); leaves every model in bf16 on ``device``."""
    shape = cf.model_shape(size)
    b, T = plan["check"]
    tokens = torch.randint(0, shape.vocab_size, (b, T), generator=gen)
    calib = torch.randint(0, shape.vocab_size, (1, plan["calib_seq"]), generator=gen).to(device)
    fresh = torch.randint(0, shape.vocab_size, plan["fresh"], generator=gen).to(device)
    models = {**{f"{v} topk": m for v, m in topk.items()}, **{f"{v} threshold": m for v, m in thresh.items()}}
    with torch.inference_mode():
        for v, model in thresh.items():
            calibrate_student_threshold(model, calib, GAMMA)
        on_device = {name: tuple(x.cpu() if torch.is_tensor(x) else {i: t.cpu() for i, t in x.items()}
                                 for x in student_forward(m, tokens.to(device))) for name, m in models.items()}
    for v, model in thresh.items():
        checks.record(f"b fp32 {v}: cached decode = full forward on {device.type}",
                      lambda: check_decode(model, tokens.to(device), plan["check_prompt"], torch.float32))
    for m in (dense, *models.values()):
        m.to("cpu")
    with torch.inference_mode():
        for name, m in models.items():
            checks.record(f"a fp32 {name}: {device.type} forward = cpu forward",
                          lambda: compared_ok(compare(student_forward(m, tokens), on_device[name]), torch.float32))
    del on_device
    for m in (dense, *models.values()):
        m.to(device)
        cast_params(m, torch.bfloat16)
    for v, model in thresh.items():
        checks.record(f"c bf16 {v} threshold: calibrated to γ, not position order",
                      lambda: check_threshold_bf16(model, calib, fresh))
        checks.record(f"b bf16 {v}: cached decode = full forward (loose)",
                      lambda: check_decode(model, tokens.to(device), plan["check_prompt"], torch.bfloat16))
    for v, model in topk.items():
        checks.record(f"c bf16 {v} topk: exactly floor(γT), not position order", lambda: check_topk_bf16(model, fresh))


# ---- 2. timings ------------------------------------------------------------------------------------------


def time_prefill(size, plan, dense, topk, device, gen) -> List[Dict]:
    shape, rows = cf.model_shape(size), []
    for b, T in plan["prefill"]:
        tokens = torch.randint(0, shape.vocab_size, (b, T), generator=gen).to(device)
        fns = {n: synced(lambda m=m: m(tokens), device) for n, m in {"dense": dense, **topk}.items()}
        with torch.inference_mode():
            times = interleaved(fns, rounds=plan["rounds"], warmup=plan["warmup"], budget_s=plan["budget_s"], min_rounds=2)
        for v in topk:
            closed = cf.flop_ratio(shape, shapes_for(size, v, routing_for(v, capacity=GAMMA, student="topk"))[1], T)
            rows.append(row("prefill", f"b {b} × T {T}", v, times["dense"], times[v], closed, "FLOPs"))
    return rows


def time_train(size, plan, dense, device, dtype, gen) -> List[Dict]:
    shape, rows = cf.model_shape(size), []
    models, rshapes = {"dense": dense}, {}
    for v in VARIANTS:
        routing = routing_for(v, capacity=GAMMA)  # teacher top-k at γ, as run.py's training section
        models[v] = build_like(dense, v, size, **routing).to(device)
        cast_params(models[v], dtype)
        rshapes[v] = shapes_for(size, v, routing)[1]
    loss_fn, optimizer = prepare_training(models)
    try:
        for b, T in plan["train"]:
            tokens = torch.randint(0, shape.vocab_size, (b, T), generator=gen).to(device)

            def step(name):
                train_loss(models[name], name, tokens, loss_fn).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            fns = {n: synced(lambda n=n: step(n), device) for n in models}
            times = interleaved(fns, rounds=plan["rounds"], warmup=plan["warmup"], budget_s=plan["budget_s"], min_rounds=2)
            peak = {}
            if device.type == "cuda":  # one more step per model, for its peak memory
                for n in models:
                    torch.cuda.reset_peak_memory_stats(device)
                    fns[n]()
                    peak[n] = torch.cuda.max_memory_allocated(device) / 2**30
            for v in VARIANTS:
                note = f"peak {peak['dense']:.1f} / {peak[v]:.1f} GiB" if peak else ""
                rows.append(row("train step", f"b {b} × T {T}", v, times["dense"], times[v],
                                cf.flop_ratio(shape, rshapes[v], T, training=True), "training FLOPs", note,
                                peak_gib=peak.get(v), dense_peak_gib=peak.get("dense")))
    finally:
        del optimizer
        for m in models.values():
            m.zero_grad(set_to_none=True)
            m.set_num_output_chunks(1)
            m.eval()
    return rows


def time_decode(size, plan, dense, thresh, device, dtype, gen) -> List[Dict]:
    shape = cf.model_shape(size)
    b, context, steps = plan["decode"]
    max_len = context + steps
    models = {"dense": dense, **thresh}
    prompt = torch.randint(0, shape.vocab_size, (b, context), generator=gen).to(device)
    tokens = torch.randint(0, shape.vocab_size, (b, steps), generator=gen).to(device)
    masks = causal_cache_mask(b, max_len, max_len, device=device)
    positions = [torch.full((b,), context + i, device=device) for i in range(steps)]
    phases = {n: [] for n in models}
    for m in models.values():
        with torch.device(device):
            m.setup_caches(batch_size=b, dtype=dtype, decoder_max_seq_len=max_len)

    def generate(name):
        m = models[name]
        m.reset_caches()
        sync(device)
        t0 = time.perf_counter()
        m(prompt, mask=masks[:, :context], input_pos=torch.arange(context, device=device))
        sync(device)
        t1 = time.perf_counter()
        if name != "dense":
            m.reset_routing_counters()
        for i in range(steps):
            m(tokens[:, i:i + 1], mask=masks[:, context + i:context + i + 1], input_pos=positions[i])
        sync(device)
        phases[name].append(dict(prefill=t1 - t0, decode=time.perf_counter() - t1))

    try:
        with torch.inference_mode():
            interleaved({n: (lambda n=n: generate(n)) for n in models}, rounds=plan["decode_rounds"], warmup=1,
                        budget_s=plan["budget_s"], min_rounds=2)
    finally:
        for m in models.values():
            delete_kv_caches(m)  # training (teacher mode) refuses caches
    rows, prefill_rows, mean_ctx = [], [], context + (steps + 1) / 2
    dense_decode = [p["decode"] / steps for p in phases["dense"][1:]]
    for v, m in thresh.items():
        executed = m.executed_fractions()  # decode steps of the last round
        rshape = shapes_for(size, v, routing_for(v, capacity=GAMMA, student="threshold"))[1]
        flops = (cf.decode_step_flops(shape, rshape, batch=b, context=mean_ctx, rows={l: b * f for l, f in executed.items()})
                 / cf.decode_step_flops(shape, cf.RoutingShape.dense(), batch=b, context=mean_ctx))
        nbytes = cf.decode_bytes_ratio(shape, rshape, bytes_per_value=2, batch=b, context=mean_ctx)["ratio"]
        gamma_bar = sum(executed.values()) / len(executed)
        routed = [p["decode"] / steps for p in phases[v][1:]]
        r = row("decode step", f"b {b}, prompt {context} + {steps} steps", v, dense_decode, routed, flops,
                "decode FLOPs (γ̄)", f"γ̄ {gamma_bar:.2f}, bytes ratio {nbytes:.3f}, tokens/s ×{1 / paired_ratio({'r': routed, 'd': dense_decode}, 'r', 'd'):.2f}",
                bytes_ratio=nbytes, executed_fraction=executed,
                dense_tokens_per_s=b / median(dense_decode), routed_tokens_per_s=b / median(routed))
        rows.append(r)
        prefill_rows.append(row("prefill (cached, threshold)", f"b {b} × T {context}", v, [p["prefill"] for p in phases["dense"][1:]],
                        [p["prefill"] for p in phases[v][1:]], None, "", "ragged threshold batch, no closed form"))
    return rows + prefill_rows


def kernel_profile(fn: Callable, device: torch.device, setup: Callable = lambda: None, repeats: int = 3) -> Dict:
    """Where a call's time goes: its wall time unprofiled (median of ``repeats``, each after ``setup``, which is
    not measured), then one profiled call's GPU kernels (count, summed duration) and ``aten::`` operator calls.
    A call whose kernels keep the GPU busy for only a small share of its wall time is bound by launching them,
    not by its FLOPs."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(repeats + 1):  # the first is a warm-up
        setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
    setup()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    wall_ms = 1e3 * median(walls[1:])
    kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    return dict(wall_ms=wall_ms, kernels=len(kernels), kernel_ms=kernel_ms,
                gpu_busy=kernel_ms / wall_ms if kernels else None,
                aten_ops=sum(1 for e in events if e.name.startswith("aten::")))


def profile_launches(size, plan, dense, topk, thresh, device, dtype, gen) -> List[Dict]:
    """Kernel counts and GPU-busy share of dense and routed models: a top-k prefill per prefill shape, and one
    decode step of the threshold students with the selective cache after a fresh prompt prefill (not measured)."""
    shape, rows = cf.model_shape(size), []
    b, context, _ = plan["decode"]
    prompt = torch.randint(0, shape.vocab_size, (b, context + 1), generator=gen).to(device)
    masks = causal_cache_mask(b, context + 1, context + 1, device=device)
    with torch.inference_mode():
        for pb, T in plan["prefill"]:
            tokens = torch.randint(0, shape.vocab_size, (pb, T), generator=gen).to(device)
            for name, m in {"dense": dense, **topk}.items():
                rows.append(dict(call=f"prefill b {pb} × T {T}", model=name, **kernel_profile(lambda m=m: m(tokens), device)))
        for name, m in {"dense": dense, **thresh}.items():
            with torch.device(device):
                m.setup_caches(batch_size=b, dtype=dtype, decoder_max_seq_len=context + 1)
            try:
                def prefill_prompt(m=m):
                    m.reset_caches()
                    m(prompt[:, :context], mask=masks[:, :context], input_pos=torch.arange(context, device=device))

                def decode_step(m=m):
                    m(prompt[:, context:], mask=masks[:, context:], input_pos=torch.full((b,), context, device=device))

                rows.append(dict(call=f"decode step b {b}, context {context}", model=name,
                                 **kernel_profile(decode_step, device, setup=prefill_prompt)))
            finally:
                delete_kv_caches(m)
    return rows


def run_compiled(size: str, device: torch.device, out_dir: Path, overwrite: bool = False) -> List[Dict]:
    """``benchmarks.compiled`` on ``device`` (its own models and files, OUT/compiled/); nothing joins the eager rows."""
    compiled_benchmark.main([*COMPILED_ARGS[size], "--device", str(device), "--out", str(out_dir / "compiled"),
                             *(["--overwrite"] if overwrite else [])])
    return []


def row(section, shape, variant, dense_times, routed_times, closed, closed_of, note="", **extra) -> Dict:
    return dict(section=section, shape=shape, variant=variant, dense_ms=1e3 * median(dense_times),
                routed_ms=1e3 * median(routed_times), ratio=paired_ratio({"r": routed_times, "d": dense_times}, "r", "d"),
                closed=closed, closed_of=closed_of, note=note, rounds=len(routed_times),
                dense_times=list(dense_times), routed_times=list(routed_times), **extra)


# ---- report ------------------------------------------------------------------------------------------------


def render(results: Dict) -> str:
    meta = results["meta"]
    out = [f"## GPU check and timings: `{meta['command']}`", "",
           f"Device {meta['device_name']}, torch {meta['torch']}, timings in {meta['dtype']}, shape `{meta['size']}`, "
           f"γ = {GAMMA} on every other layer, {meta['elapsed_s']:.0f} s in all.", "",
           f"### Checks: {'not run' if not results['checks'] else 'all pass' if results['checks_passed'] else '**FAIL**'}", "",
           "| check | result | numbers |", "|---|---|---|"]
    for c in results["checks"]:
        nums = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()
                         if k not in ("check", "passed", "traceback", "calibrated", "fresh"))
        out.append(f"| {c['check']} | {'pass' if c['passed'] else '**FAIL**'} | {nums} |")
    out += ["", "### Timings (median of per-round routed/dense ratios)", "",
            "| section | shape | variant | dense ms | routed ms | routed/dense | closed-form ratio | note |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results["timings"]:
        closed = f"{r['closed']:.3f} ({r['closed_of']})" if r["closed"] is not None else "–"
        out.append(f"| {r['section']} | {r['shape']} | {r['variant']} | {r['dense_ms']:.2f} | {r['routed_ms']:.2f} | "
                   f"{r['ratio']:.3f} | {closed} | {r['note']} |")
    if results.get("profile"):
        out += ["", "### Where the time goes (one profiled call; wall time unprofiled, median of 3)", "",
                "| call | model | wall ms | GPU kernels | kernel ms | GPU busy | aten ops |", "|---|---|---|---|---|---|---|"]
        for r in results["profile"]:
            busy = f"{r['gpu_busy']:.2f}" if r["gpu_busy"] is not None else "–"
            out.append(f"| {r['call']} | {r['model']} | {r['wall_ms']:.2f} | {r['kernels']} | {r['kernel_ms']:.2f} | {busy} | {r['aten_ops']} |")
    for name, err in results["errors"].items():
        out.append(f"\n**{name} failed**: `{err.splitlines()[-1]}`")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0_5b", choices=sorted(PLANS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="default benchmarks/results/gpu_<size>, or the first free _2, _3, …")
    parser.add_argument("--overwrite", action="store_true", help="replace the results an existing --out holds")
    parser.add_argument("--batch", type=int, default=None, help="batch of prefill, train and decode timings")
    parser.add_argument("--seq", type=int, default=None, help="sequence length of prefill and train timings")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="default: all")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device (use --device cpu for a smoke run)")
    start = time.perf_counter()
    plan, device, dtype = dict(PLANS[args.size]), torch.device(args.device), torch.bfloat16
    if args.batch or args.seq:
        for key in ("prefill", "train"):
            plan[key] = [(args.batch or b, args.seq or T) for b, T in plan[key][:1]]
        plan["decode"] = (args.batch or plan["decode"][0], *plan["decode"][1:])
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 checks in fp32
    # (the compiled section writes OUT/compiled/: a folder holding that alone is refused here too, not an hour in)
    out_dir = results_dir(args.out, Path(__file__).parent / "results" / f"gpu_{args.size}", overwrite=args.overwrite,
                          names=("results.json", "compiled/results.json"))
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    log(f"building {args.size} models (fp32, cpu) and moving them to {device}")
    dense = build_dense(args.size).to(device)
    topk = {v: build_like(dense, v, args.size, **routing_for(v, capacity=GAMMA, student="topk")).to(device) for v in VARIANTS}
    thresh = {v: build_like(dense, v, args.size, **routing_for(v, capacity=GAMMA, student="threshold")).to(device)
              for v in VARIANTS}
    log("correctness checks")
    checks = Checks()
    try:
        if "checks" in args.sections:
            run_checks(checks, args.size, plan, dense, topk, thresh, device, gen)
        else:
            for m in (dense, *topk.values(), *thresh.values()):
                cast_params(m, dtype)
            with torch.inference_mode():  # the decode timings and the profile run calibrated threshold students
                calib = torch.randint(0, cf.model_shape(args.size).vocab_size, (1, plan["calib_seq"]), generator=gen)
                for model in thresh.values():
                    calibrate_student_threshold(model, calib.to(device), GAMMA)
    except Exception as e:  # outside any one check (calibration, moving models): a failure, the timings still run
        checks.record("checks setup", lambda: dict(passed=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))
        for m in (dense, *topk.values(), *thresh.values()):
            m.to(device)
            cast_params(m, dtype)

    timings, profile, errors = [], [], {}
    sections = dict(prefill=lambda: time_prefill(args.size, plan, dense, topk, device, gen),
                    decode=lambda: time_decode(args.size, plan, dense, thresh, device, dtype, gen),
                    profile=lambda: profile_launches(args.size, plan, dense, topk, thresh, device, dtype, gen),
                    train=lambda: time_train(args.size, plan, dense, device, dtype, gen),  # it updates weights
                    compiled=lambda: run_compiled(args.size, device, out_dir, args.overwrite))
    for name, fn in sections.items():
        if name not in args.sections:
            continue
        log(f"timing {name}")
        try:
            (profile if name == "profile" else timings).extend(fn())
        except Exception:
            errors[name] = traceback.format_exc()
            log(f"{name} failed:\n{errors[name]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    results = dict(meta=dict(command="python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
                             size=args.size, dtype=str(dtype), torch=torch.__version__, cuda=torch.version.cuda, plan=plan,
                             device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({describe_device()['cpu']})",
                             host=describe_device(), elapsed_s=time.perf_counter() - start),
                   checks_passed=checks.passed, checks=checks.rows, timings=timings, profile=profile, errors=errors)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    markdown = render(results)
    (out_dir / "results.md").write_text(markdown)
    print(markdown)
    log(f"wrote {out_dir}/results.json and results.md")
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
