"""``torch.compile`` for routed models, applied from outside the model.

Two ways, both over the modules users already run:

* :func:`compile_layers` — every decoder layer compiled on its own, as torchtune's
  ``training.compile_model`` does (routed layers are ``TransformerSelfAttentionLayer`` subclasses, so that
  function covers them too); here with ``fullgraph`` so that a break fails loudly instead of silently
  splitting a layer into pieces. Training, prefill and evaluation use this.
* :func:`compiled_decode_step` — the gpt-fast pattern: one compiled function for the whole decode step
  (``torchtune.generation.generate_next_token``: embedding, every layer, the head and sampling) over static
  KV buffers, with ``mode="reduce-overhead"`` on CUDA so the GPU replays the step as one CUDA graph instead
  of launching its kernels one by one from Python.

What keeps the graphs whole (``docs/design.md`` R6): top-k routing has static shapes (⌊γ·n⌋ tokens per
sequence, ⌊γ·b⌋ rows per decode step), the selective cache makes its allocation decisions on the host
before the layers run (``SelectiveKVCache.make_room``) or, static, never, and each layer gets a
``RoutingContext.for_layer`` view with β as tensors, so neither the layer index nor the β schedule becomes a
guard. Threshold and window top-k routing keep one host read per routed layer per student forward (the number of
tokens the student runs decides the shapes), made in the layer's own frame, so their layers compile in two pieces
(``fullgraph=False``: the graph before the read, and one graph per count after it) whose graphs stay few over any
number of decode steps; a training forward only records the student's mask and reads nothing. One exception: a
decode step of one row either runs its token or skips it, and compiled it decides that by a ``torch.cond`` on the
device instead (``routed_block.branching_decode_step``), so a batch-1 decode step has no read at all and
:func:`compiled_decode_step` makes it one graph (tests/test_compile.py).
"""

import os
import types
from typing import Callable, Optional

import torch
from torchtune import generation
from torchtune.modules import TransformerSelfAttentionLayer

from torchtune_dtf.modules.decoder import RoutedTransformerDecoder
from torchtune_dtf.modules.layers import DroppedLayer


#: Graphs dynamo may keep per code object. Every routed layer class shares ``RoutedSelfAttentionLayer.forward``
#: and every model ``generate_next_token``: one graph per (layer class, capacity, student mode, grad mode,
#: prefill or decode step) and per model; torch's default of 8 is reached by one hybrid model with a few
#: capacities, and with ``fullgraph`` reaching it is an error.
RECOMPILE_LIMIT = 64


def _allow_graphs_per_code_object() -> None:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def routes_with_static_shapes(model: torch.nn.Module) -> bool:
    """True when every routed layer's student is top-k (or the model routes nothing): its forwards then have
    shapes that do not depend on the data, and compile whole."""
    if not isinstance(model, RoutedTransformerDecoder):
        return True
    return all(layer.student_routing_mode == "topk" for layer in model.routed_layers())


def compile_layers(
    model: torch.nn.Module, *, backend: Optional[str] = None, fullgraph: Optional[bool] = None, mode: Optional[str] = None
) -> torch.nn.Module:
    """Compile every decoder layer in place (torchtune's per-layer compile) and return the model. Dropped layers
    stay eager: they run one add or nothing.

    Args:
        model: a ``TransformerDecoder`` (dense or routed).
        backend: ``torch.compile`` backend; ``TORCH_COMPILE_BACKEND`` or inductor by default, as torchtune.
        fullgraph: refuse graph breaks; by default when the routing has static shapes
            (:func:`routes_with_static_shapes`).
        mode: ``torch.compile`` mode.
    """
    backend = backend or os.environ.get("TORCH_COMPILE_BACKEND", "inductor")
    static = routes_with_static_shapes(model)
    fullgraph = static if fullgraph is None else fullgraph
    _allow_graphs_per_code_object()
    if isinstance(model, RoutedTransformerDecoder) and next(model.parameters()).device.type != "meta":
        for layer in model.routed_layers():
            layer.routing_counts()  # create the counters now: their creation in a forward would be one more graph
    for module in model.modules():
        # A dropped layer runs one add at most: compiled, its call would cost a graph's entry (dynamo's guards,
        # ≈ 20 µs on a CPU) for an operator that eager code runs in a few (benchmarks/decode_layer_calls.py).
        if isinstance(module, TransformerSelfAttentionLayer) and not isinstance(module, DroppedLayer):
            # Threshold graphs specialise on each selected count (``dynamic=False``): few per batch size, and
            # inductor (torch 2.13, CPU) generated code with an unbound size symbol for the count-dependent
            # pieces when it was left to mark them dynamic.
            module.compile(backend=backend, fullgraph=fullgraph, mode=mode, dynamic=None if static else False)
    return model


def compiled_decode_step(
    model: torch.nn.Module, *, backend: Optional[str] = None, mode: Optional[str] = None
) -> Callable:
    """A compiled ``generate_next_token`` for ``torchtune.generation.generate(custom_generate_next_token=...)``.

    Makes the model's selective caches static first (:meth:`RoutedTransformerDecoder.use_static_kv_caches`;
    call this before ``setup_caches``): a growing cache would change shapes as it grows. ``mode`` defaults to
    ``"reduce-overhead"`` (CUDA graphs) when the model's parameters are on CUDA, and to the default mode
    elsewhere (CUDA graphs do not exist on the CPU).
    """
    if isinstance(model, RoutedTransformerDecoder):
        model.use_static_kv_caches()
        for layer in model.routed_layers():
            layer.routing_counts()
    if mode is None:
        on_cuda = next(model.parameters()).device.type == "cuda"
        mode = "reduce-overhead" if on_cuda else None
    backend = backend or os.environ.get("TORCH_COMPILE_BACKEND", "inductor")
    _allow_graphs_per_code_object()
    return torch.compile(_own_copy(generation.generate_next_token), backend=backend, mode=mode,
                         fullgraph=routes_with_static_shapes(model))


def _own_copy(function: Callable) -> Callable:
    """``function`` with a code object of its own. Dynamo keeps compiled graphs per code object, shared by every
    ``torch.compile`` of that function: two models' decode steps (one ``fullgraph``, one with threshold graph
    breaks) would share one cache, and measured here a dense model's compiled step then kept running eager code.
    A copy per model keeps each step's graphs apart."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = dict(function.__kwdefaults__ or {})
    copy.__doc__, copy.__module__, copy.__qualname__ = function.__doc__, function.__module__, function.__qualname__
    return copy
