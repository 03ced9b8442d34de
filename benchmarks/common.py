"""Model building, student calibration, FLOP counting, timing and profiling helpers for the benchmarks.

Everything measured runs the package's own modules: models come from ``torchtune_dtf.models.qwen2_5``
builders with the routing hyperparameters of the repo's configs (``configs/{mod,sdt,stt}_qwen0_5b.yaml``),
and forwards go through ``RoutedTransformerDecoder.forward`` / the routed layers' ``forward`` unchanged.
"""

import contextlib
import functools
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from torchtune_dtf.models import qwen2_5
from torchtune_dtf.modules import ROUTING_MODULE_NAMES, RoutedSelfAttentionLayer, RoutingContext, is_routing_key
from torchtune_dtf.training.calibration import calibratable_layers, calibrate_student_routers

from torchtune_dtf import closed_form as cf

REPO = Path(__file__).resolve().parent.parent
aten = torch.ops.aten

# ---- routing hyperparameters ----------------------------------------------------------------------


def config_routing(variant: str) -> Dict:
    """Routing kwargs of ``configs/{variant}_qwen0_5b.yaml`` (the model section minus ``_component_``),
    placed on every other layer."""
    if variant == "dense":
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "configs" / f"{variant}_qwen0_5b.yaml")
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("_component_")
    # The speed bars and closed forms are stated for γ on every other layer (docs/design.md §8), whatever
    # placement the training configs ship.
    model["routed_layers"] = "every_other"
    return model


def routing_for(variant: str, *, capacity: Optional[float] = None, student: Optional[str] = None,
                threshold: Optional[float] = None, **overrides) -> Dict:
    """Config routing kwargs with capacity / student routing mode overridden.

    ``student="topk"``: per-sequence top-k of the causal router on a prompt (exact capacity).
    ``student="threshold"``: σ(r̃) > ``threshold`` (default: the config's τ).
    """
    routing = config_routing(variant)
    if variant == "dense":
        return routing
    if capacity is not None:
        routing["capacity"] = capacity
    if student == "topk":
        # Timing a prefill without a cache: the non-causal whole-sequence top-k is what is measured.
        routing.update(student_routing_mode="topk", student_threshold=None, allow_noncausal_student_topk=True)
    elif student == "threshold":
        routing["student_routing_mode"] = "threshold"
        if threshold is not None:
            routing["student_threshold"] = threshold
    routing.update(overrides)
    return routing


# ---- building ---------------------------------------------------------------------------------------


def builder(variant: str, size: str) -> Callable[..., torch.nn.Module]:
    """The package's ``{variant}_qwen2_5_{size}`` builder (``tiny``: with ``closed_form.TINY_ARGS`` bound)."""
    build = getattr(qwen2_5, f"{variant}_qwen2_5_{size}")
    return functools.partial(build, **cf.TINY_ARGS) if size == "tiny" else build


def build_dense(size: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return builder("dense", size)().eval()


def build_like(dense: torch.nn.Module, variant: str, size: str, seed: int = 0, **routing) -> torch.nn.Module:
    """A ``variant`` model whose backbone parameters *are* the parameters of ``dense`` (same objects).

    The model is built by the package's builder under the meta device (as torchtune's distributed recipes
    do), every backbone parameter is replaced by the dense model's parameter of the same name (strict: the
    names must match 1:1 apart from routing parameters), and the routing modules are materialised and
    initialised by their own ``reset_parameters``. Memory stays at one backbone for any number of variants,
    every variant computes with exactly the dense weights, and one optimizer state serves all of them.
    """
    if variant == "dense":
        return dense
    return build_sharing(dense, lambda: builder(variant, size)(**routing), seed=seed)


def build_sharing(dense: torch.nn.Module, build: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    """``build()`` under the meta device, its backbone parameters replaced by ``dense``'s (see :func:`build_like`)."""
    with torch.device("meta"):
        model = build()
    dense_params = dict(dense.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    backbone = [n for n in names if not is_routing_key(n)]
    if sorted(backbone) != sorted(dense_params):
        raise RuntimeError(f"backbone mismatch: {sorted(set(backbone) ^ set(dense_params))[:5]}")
    for name in backbone:
        owner, leaf = name.rsplit(".", 1)
        model.get_submodule(owner)._parameters[leaf] = dense_params[name]
    torch.manual_seed(seed + 1)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ROUTING_MODULE_NAMES:
            module.to_empty(device="cpu", recurse=True)
            module.reset_parameters()
    for module in model.modules():  # non-persistent buffers (RoPE cache) are not parameters
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            module.rope_init()
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftovers:
        raise RuntimeError(f"still on meta: {leftovers[:5]}")
    return model.eval()


def routed_layers(model) -> List[RoutedSelfAttentionLayer]:
    return [layer for layer in model.layers if isinstance(layer, RoutedSelfAttentionLayer)]


def set_capacity(model, gamma: float) -> None:
    for layer in routed_layers(model):
        layer.capacity = gamma


@functools.lru_cache(maxsize=None)
def config_loss_weights(variant: str) -> Tuple[float, float, float]:
    """(λ_pred, λ_causal, λ_g_reg) after warmup in the shipped 0.5B training config of ``variant``
    (``stt_kv`` and other benchmark names of a variant use that variant's config). Read once per process:
    training steps call it every step, and parsing the YAML (ms) is not the step's work."""
    from omegaconf import OmegaConf

    from torchtune_dtf.training.schedules import LossWeights

    cfg = OmegaConf.load(REPO / "configs" / f"{variant.split('_')[0]}_qwen0_5b.yaml").routing_loss_weights
    return LossWeights(**cfg).at(cfg.warmup_steps)


def calibrate_student_threshold(model, tokens: torch.Tensor, fraction: float, rounds: int = 2) -> Dict[int, float]:
    """Calibrate every threshold student of ``model`` to execute ``fraction`` of ``tokens``
    (:func:`torchtune_dtf.training.calibration.calibrate_student_routers`); returns the fractions after."""
    targets = {layer.layer_idx: fraction for layer in calibratable_layers(model)}
    return calibrate_student_routers(model, [{"tokens": tokens}], targets, rounds)


# ---- FLOP counting ----------------------------------------------------------------------------------


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode knows the CUDA SDPA kernels but not the CPU flash kernel; count it with torch's own formula.
CPU_SDPA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}
ATTENTION_OPS = {"aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention_for_cpu_backward",
                 "aten.bmm", "aten.baddbmm", "aten._scaled_dot_product_flash_attention",
                 "aten._scaled_dot_product_efficient_attention"}


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)


def categorize_flops(counter: FlopCounterMode) -> Dict[str, int]:
    """Measured FLOPs split like :func:`closed_form.forward_flops`: attention (SDPA / bmm ops), routers
    (modules named causal_router, mod_router, transition, prior_ffn), LM head (everything outside the decoder
    layers: the tied output projection), block linear (the rest)."""
    counts = counter.get_flop_counts()
    total = sum(counts["Global"].values())
    attention = sum(v for op, v in counts["Global"].items() if str(op) in ATTENTION_OPS)
    routers = 0
    layers = 0
    for name, ops in counts.items():
        parts = name.split(".")
        if parts[-1] in ROUTING_MODULE_NAMES:
            routers += sum(ops.values())
        if len(parts) == 3 and parts[1] == "layers":
            layers += sum(ops.values())
    lm_head = total - layers
    return dict(block_linear=total - attention - routers - lm_head, attention=attention, lm_head=lm_head,
                routers=routers, total=total)


# ---- where results go -------------------------------------------------------------------------------


def results_dir(out: Optional[os.PathLike], default: Path, *, overwrite: bool = False,
                names: Iterable[str] = ("results.json",)) -> Path:
    """The folder a benchmark will write ``names`` into, decided before it runs (the first write may be an hour in).

    Folders under ``benchmarks/results/`` are committed evidence that the README and docs quote, so nothing is
    replaced silently: an explicit ``out`` that already holds one of ``names`` is refused unless ``overwrite``, and
    where the ``default`` folder holds them the first free ``<default>_2``, ``<default>_3``, … is used instead.
    """
    names = tuple(names)

    def holds_results(folder: Path) -> bool:
        return any((folder / name).exists() for name in names)

    if out is not None:
        folder = Path(out)
        if holds_results(folder) and not overwrite:
            raise SystemExit(f"{folder} already holds {', '.join(n for n in names if (folder / n).exists())}: "
                             "pass --overwrite to replace it, or choose another --out")
        return folder
    folder, number = Path(default), 1
    while holds_results(folder) and not overwrite:
        number += 1
        folder = Path(default).with_name(f"{Path(default).name}_{number}")
    return folder


# ---- timing ------------------------------------------------------------------------------------------


def set_threads(n: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


@contextlib.contextmanager
def subnormals_flushed(enabled: bool) -> Iterator[bool]:
    """Flush subnormal floats to zero inside the block when ``enabled`` and the CPU supports it (see benchmarks/README.md:
    random-weight softmax gradients); yields whether flushing is on. The process default (off) comes back
    afterwards, since the benchmarks' entry points also run inside test sessions."""
    flushed = enabled and torch.set_flush_denormal(True)
    try:
        yield flushed
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (a no-op on CPU), so a timer read next measures them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cast_params(model, dtype) -> None:
    """Floating parameters to ``dtype`` in place (shared backbone objects once); buffers keep their dtype."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(fns: Dict[str, Callable[[], object]], *, rounds: int, warmup: int = 1,
                budget_s: Optional[float] = None, min_rounds: int = 1) -> Dict[str, List[float]]:
    """Time each function ``rounds`` times, interleaving them (A B C, B C A, …) so that drift and load from
    other processes on the shared CPU hit every variant alike. ``warmup`` untimed rounds first. Stops early
    (after ``min_rounds``) once ``budget_s`` seconds of timed rounds are spent."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(fns[name]))
        if budget_s is not None and r + 1 >= min_rounds and time.perf_counter() - start > budget_s:
            break
    return times


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def paired_ratio(times: Dict[str, List[float]], num: str, den: str) -> float:
    """Median over rounds of the per-round ratio num/den. The two timings of a round are adjacent in time, so
    slow changes of the machine's load (other jobs on the shared cores) cancel in each ratio."""
    return median(a / b for a, b in zip(times[num], times[den]))


# ---- profiling ---------------------------------------------------------------------------------------


def profile_ops(fn: Callable[[], object]) -> List[Tuple[str, str, float, int]]:
    """One profiled call: (op name, input shapes, self CPU ms, calls) per op and input shape."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    rows = [(e.key, str(e.input_shapes), e.self_cpu_time_total / 1e3, e.count)
            for e in prof.key_averages(group_by_input_shape=True)]
    return sorted(rows, key=lambda r: -r[2])


# ---- masks for cached decoding --------------------------------------------------------------------


def causal_cache_mask(batch: int, rows: int, max_len: int, offset: int = 0, device=None) -> torch.Tensor:
    """torchtune-style boolean mask ``[b, rows, max_len]`` for tokens at positions offset … offset+rows−1."""
    q = torch.arange(offset, offset + rows, device=device)[:, None]
    k = torch.arange(max_len, device=device)[None, :]
    return (k <= q).expand(batch, -1, -1)


def shapes_for(size: str, variant: str, routing: Dict) -> Tuple[cf.ModelShape, cf.RoutingShape]:
    shape = cf.model_shape(size)
    return shape, cf.routing_shape(variant, shape.num_layers, shape.embed_dim, routing)
