"""Model builders: {dense, mod, sdt, stt} × Qwen2.5 {0.5B, 1.5B, 3B, 7B, tiny}, each with a LoRA twin.

Each builder is a config's ``model._component_`` (``torchtune_dtf.models.qwen2_5.stt_qwen2_5_0_5b``) and
fixes the architecture (``QWEN2_5_SHAPES``) of :func:`routed_qwen2` or :func:`lora_routed_qwen2`, as
torchtune's ``qwen2_5_*`` builders fix that of ``qwen2``. Its keyword-only parameters are the variant's
routing arguments (``routing_config.REQUIRED_KEYS[variant]``, in that order), all required and documented
once, in :func:`routed_qwen2`; :mod:`torchtune_dtf.models.routing_presets` returns the complete sets of the
shipped configs. LoRA twins first take ``lora_attn_modules`` and ``apply_lora_to_mlp`` (positional, as in
torchtune) and the keyword-only ``lora_rank``, ``lora_alpha``, ``lora_dropout``.

A builder passes its arguments on as ``**locals()``: as the first expression of the body, ``locals()`` is
exactly the builder's parameters, so none of them can be wired to the wrong key by a typo
(``tests/test_builders.py`` checks every signature against ``REQUIRED_KEYS``). ``@_model_builder(variant, size)``
declares what the builder builds (its ``identity``, which :mod:`torchtune_dtf.models.model_config` reads instead
of parsing names) and keeps the project's promise of one error listing every missing, unknown and invalid routing
argument, where Python alone would stop at the first unknown keyword.

The architecture numbers are Qwen2.5's (as torchtune's builders; 1.5B and 7B with the base models' 131072
``max_seq_len``). ``tiny`` is a shape for tests and CPU smoke runs; its builders also require ``vocab_size``
(to match the tokenizer of the checkpoint) and ``max_seq_len``, which no default could know.

Example:
    >>> from torchtune_dtf.models.qwen2_5 import stt_qwen2_5_0_5b
    >>> from torchtune_dtf.models.routing_presets import stt_routing
    >>> model = stt_qwen2_5_0_5b(**stt_routing(capacity=0.25))  # the shipped config at γ = 0.25
"""

import functools
import inspect
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_dtf.models.qwen2_5._component_builders import BuilderIdentity, lora_routed_qwen2, routed_qwen2
from torchtune_dtf.models.routing_config import REQUIRED_KEYS, Capacity, Placement, validate_routing
from torchtune_dtf.modules.decoder import RoutedTransformerDecoder

_COMMON = dict(attn_dropout=0.0, norm_eps=1e-6, rope_base=1_000_000.0)

#: Architecture of each size: the fields of :class:`Qwen2Architecture`. ``tiny`` lacks ``vocab_size`` and
#: ``max_seq_len``, which its builders require. Read-only, since every later build would see an edit.
QWEN2_5_SHAPES: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "0_5b": MappingProxyType(dict(vocab_size=151936, num_layers=24, num_heads=14, num_kv_heads=2, embed_dim=896,
                                  intermediate_dim=4864, max_seq_len=32768, tie_word_embeddings=True, **_COMMON)),
    "1_5b": MappingProxyType(dict(vocab_size=151936, num_layers=28, num_heads=12, num_kv_heads=2, embed_dim=1536,
                                  intermediate_dim=8960, max_seq_len=131072, tie_word_embeddings=True, **_COMMON)),
    "3b": MappingProxyType(dict(vocab_size=151936, num_layers=36, num_heads=16, num_kv_heads=2, embed_dim=2048,
                                intermediate_dim=11008, max_seq_len=32768, tie_word_embeddings=True, **_COMMON)),
    "7b": MappingProxyType(dict(vocab_size=152064, num_layers=28, num_heads=28, num_kv_heads=4, embed_dim=3584,
                                intermediate_dim=18944, max_seq_len=131072, tie_word_embeddings=False, **_COMMON)),
    "tiny": MappingProxyType(dict(num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
                                  tie_word_embeddings=True, **_COMMON)),
})


#: Every model builder of the package by what it builds: ``(variant, size, lora)`` → builder.
MODEL_BUILDERS: Dict[Tuple[str, str, bool], Callable[..., RoutedTransformerDecoder]] = {}


def _model_builder(variant: str, size: str, *, lora: bool = False):
    """Register a builder of ``variant`` at ``size`` (``identity`` attribute, :data:`MODEL_BUILDERS`) and make it
    report argument problems as :func:`validate_routing` does.

    Python's TypeError names the first unknown keyword and stops; a call that does not bind is instead checked
    by :func:`validate_routing`, whose ValueError lists every missing, unknown and invalid routing argument
    (the TypeError stays attached as its cause; when the routing arguments are fine, e.g. a LoRA argument is
    missing, the TypeError is Python's). Name, docstring and ``inspect.signature`` are the builder's.
    """
    num_layers = QWEN2_5_SHAPES[size]["num_layers"]

    def register(builder: Callable[..., RoutedTransformerDecoder]) -> Callable[..., RoutedTransformerDecoder]:
        signature = inspect.signature(builder)
        not_routing = set(signature.parameters) - set(REQUIRED_KEYS[variant])  # LoRA and tiny-shape arguments

        @functools.wraps(builder)
        def build(*args: Any, **kwargs: Any) -> RoutedTransformerDecoder:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as err:
                routing = {key: value for key, value in kwargs.items() if key not in not_routing}
                try:
                    validate_routing(variant, num_layers, **routing)
                except ValueError as problems:
                    raise problems from err
            # Binds, or fails for a non-routing argument: then Python's own TypeError, which names the builder.
            return builder(*args, **kwargs)

        build.identity = BuilderIdentity(variant=variant, size=size, lora=lora)
        MODEL_BUILDERS[(variant, size, lora)] = build
        return build

    return register


@_model_builder("dense", "0_5b")
def dense_qwen2_5_0_5b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-0.5B (24 layers, d = 896).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["0_5b"])


@_model_builder("dense", "1_5b")
def dense_qwen2_5_1_5b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-1.5B (28 layers, d = 1536).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["1_5b"])


@_model_builder("dense", "3b")
def dense_qwen2_5_3b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-3B (36 layers, d = 2048).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["3b"])


@_model_builder("dense", "7b")
def dense_qwen2_5_7b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-7B (28 layers, d = 3584).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["7b"])


@_model_builder("dense", "tiny")
def dense_qwen2_5_tiny(
    *,
    vocab_size: int, max_seq_len: int,
) -> RoutedTransformerDecoder:
    """Dense tiny Qwen2.5-shaped model (4 layers, d = 64).

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["tiny"], **locals())


@_model_builder("mod", "0_5b")
def mod_qwen2_5_0_5b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """MoD (Mixture-of-Depths) Qwen2.5-0.5B (24 layers, d = 896).

    Takes MoD's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("mod", **QWEN2_5_SHAPES["0_5b"], **locals())


@_model_builder("mod", "1_5b")
def mod_qwen2_5_1_5b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """MoD (Mixture-of-Depths) Qwen2.5-1.5B (28 layers, d = 1536).

    Takes MoD's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("mod", **QWEN2_5_SHAPES["1_5b"], **locals())


@_model_builder("mod", "3b")
def mod_qwen2_5_3b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """MoD (Mixture-of-Depths) Qwen2.5-3B (36 layers, d = 2048).

    Takes MoD's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("mod", **QWEN2_5_SHAPES["3b"], **locals())


@_model_builder("mod", "7b")
def mod_qwen2_5_7b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """MoD (Mixture-of-Depths) Qwen2.5-7B (28 layers, d = 3584).

    Takes MoD's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return routed_qwen2("mod", **QWEN2_5_SHAPES["7b"], **locals())


@_model_builder("mod", "tiny")
def mod_qwen2_5_tiny(
    *,
    vocab_size: int, max_seq_len: int,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """MoD (Mixture-of-Depths) tiny Qwen2.5-shaped model (4 layers, d = 64).

    Takes MoD's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return routed_qwen2("mod", **QWEN2_5_SHAPES["tiny"], **locals())


@_model_builder("sdt", "0_5b")
def sdt_qwen2_5_0_5b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """SDT (Subjective Depth) Qwen2.5-0.5B (24 layers, d = 896).

    Takes SDT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("sdt", **QWEN2_5_SHAPES["0_5b"], **locals())


@_model_builder("sdt", "1_5b")
def sdt_qwen2_5_1_5b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """SDT (Subjective Depth) Qwen2.5-1.5B (28 layers, d = 1536).

    Takes SDT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("sdt", **QWEN2_5_SHAPES["1_5b"], **locals())


@_model_builder("sdt", "3b")
def sdt_qwen2_5_3b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """SDT (Subjective Depth) Qwen2.5-3B (36 layers, d = 2048).

    Takes SDT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("sdt", **QWEN2_5_SHAPES["3b"], **locals())


@_model_builder("sdt", "7b")
def sdt_qwen2_5_7b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """SDT (Subjective Depth) Qwen2.5-7B (28 layers, d = 3584).

    Takes SDT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return routed_qwen2("sdt", **QWEN2_5_SHAPES["7b"], **locals())


@_model_builder("sdt", "tiny")
def sdt_qwen2_5_tiny(
    *,
    vocab_size: int, max_seq_len: int,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """SDT (Subjective Depth) tiny Qwen2.5-shaped model (4 layers, d = 64).

    Takes SDT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return routed_qwen2("sdt", **QWEN2_5_SHAPES["tiny"], **locals())


@_model_builder("stt", "0_5b")
def stt_qwen2_5_0_5b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """STT (Subjective Timescale) Qwen2.5-0.5B (24 layers, d = 896).

    Takes STT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("stt", **QWEN2_5_SHAPES["0_5b"], **locals())


@_model_builder("stt", "1_5b")
def stt_qwen2_5_1_5b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """STT (Subjective Timescale) Qwen2.5-1.5B (28 layers, d = 1536).

    Takes STT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("stt", **QWEN2_5_SHAPES["1_5b"], **locals())


@_model_builder("stt", "3b")
def stt_qwen2_5_3b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """STT (Subjective Timescale) Qwen2.5-3B (36 layers, d = 2048).

    Takes STT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("stt", **QWEN2_5_SHAPES["3b"], **locals())


@_model_builder("stt", "7b")
def stt_qwen2_5_7b(
    *,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """STT (Subjective Timescale) Qwen2.5-7B (28 layers, d = 3584).

    Takes STT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return routed_qwen2("stt", **QWEN2_5_SHAPES["7b"], **locals())


@_model_builder("stt", "tiny")
def stt_qwen2_5_tiny(
    *,
    vocab_size: int, max_seq_len: int,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """STT (Subjective Timescale) tiny Qwen2.5-shaped model (4 layers, d = 64).

    Takes STT's routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return routed_qwen2("stt", **QWEN2_5_SHAPES["tiny"], **locals())


@_model_builder("dense", "0_5b", lora=True)
def lora_dense_qwen2_5_0_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
) -> RoutedTransformerDecoder:
    """LoRA Dense Qwen2.5-0.5B (24 layers, d = 896).

    LoRA twin of :func:`dense_qwen2_5_0_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`.

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("dense", **QWEN2_5_SHAPES["0_5b"], **locals())


@_model_builder("dense", "1_5b", lora=True)
def lora_dense_qwen2_5_1_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
) -> RoutedTransformerDecoder:
    """LoRA Dense Qwen2.5-1.5B (28 layers, d = 1536).

    LoRA twin of :func:`dense_qwen2_5_1_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`.

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("dense", **QWEN2_5_SHAPES["1_5b"], **locals())


@_model_builder("dense", "3b", lora=True)
def lora_dense_qwen2_5_3b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
) -> RoutedTransformerDecoder:
    """LoRA Dense Qwen2.5-3B (36 layers, d = 2048).

    LoRA twin of :func:`dense_qwen2_5_3b`; the LoRA arguments are those of :func:`lora_routed_qwen2`.

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("dense", **QWEN2_5_SHAPES["3b"], **locals())


@_model_builder("dense", "7b", lora=True)
def lora_dense_qwen2_5_7b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
) -> RoutedTransformerDecoder:
    """LoRA Dense Qwen2.5-7B (28 layers, d = 3584).

    LoRA twin of :func:`dense_qwen2_5_7b`; the LoRA arguments are those of :func:`lora_routed_qwen2`.

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return lora_routed_qwen2("dense", **QWEN2_5_SHAPES["7b"], **locals())


@_model_builder("dense", "tiny", lora=True)
def lora_dense_qwen2_5_tiny(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    vocab_size: int, max_seq_len: int,
) -> RoutedTransformerDecoder:
    """LoRA Dense tiny Qwen2.5-shaped model (4 layers, d = 64).

    LoRA twin of :func:`dense_qwen2_5_tiny`; the LoRA arguments are those of :func:`lora_routed_qwen2`.

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return lora_routed_qwen2("dense", **QWEN2_5_SHAPES["tiny"], **locals())


@_model_builder("mod", "0_5b", lora=True)
def lora_mod_qwen2_5_0_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """LoRA MoD (Mixture-of-Depths) Qwen2.5-0.5B (24 layers, d = 896).

    LoRA twin of :func:`mod_qwen2_5_0_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes MoD's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("mod", **QWEN2_5_SHAPES["0_5b"], **locals())


@_model_builder("mod", "1_5b", lora=True)
def lora_mod_qwen2_5_1_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """LoRA MoD (Mixture-of-Depths) Qwen2.5-1.5B (28 layers, d = 1536).

    LoRA twin of :func:`mod_qwen2_5_1_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes MoD's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("mod", **QWEN2_5_SHAPES["1_5b"], **locals())


@_model_builder("mod", "3b", lora=True)
def lora_mod_qwen2_5_3b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """LoRA MoD (Mixture-of-Depths) Qwen2.5-3B (36 layers, d = 2048).

    LoRA twin of :func:`mod_qwen2_5_3b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes MoD's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("mod", **QWEN2_5_SHAPES["3b"], **locals())


@_model_builder("mod", "7b", lora=True)
def lora_mod_qwen2_5_7b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """LoRA MoD (Mixture-of-Depths) Qwen2.5-7B (28 layers, d = 3584).

    LoRA twin of :func:`mod_qwen2_5_7b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes MoD's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return lora_routed_qwen2("mod", **QWEN2_5_SHAPES["7b"], **locals())


@_model_builder("mod", "tiny", lora=True)
def lora_mod_qwen2_5_tiny(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    vocab_size: int, max_seq_len: int,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
) -> RoutedTransformerDecoder:
    """LoRA MoD (Mixture-of-Depths) tiny Qwen2.5-shaped model (4 layers, d = 64).

    LoRA twin of :func:`mod_qwen2_5_tiny`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes MoD's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.mod_routing` gives the shipped 0.5B configs' values).

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return lora_routed_qwen2("mod", **QWEN2_5_SHAPES["tiny"], **locals())


@_model_builder("sdt", "0_5b", lora=True)
def lora_sdt_qwen2_5_0_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA SDT (Subjective Depth) Qwen2.5-0.5B (24 layers, d = 896).

    LoRA twin of :func:`sdt_qwen2_5_0_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes SDT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("sdt", **QWEN2_5_SHAPES["0_5b"], **locals())


@_model_builder("sdt", "1_5b", lora=True)
def lora_sdt_qwen2_5_1_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA SDT (Subjective Depth) Qwen2.5-1.5B (28 layers, d = 1536).

    LoRA twin of :func:`sdt_qwen2_5_1_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes SDT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("sdt", **QWEN2_5_SHAPES["1_5b"], **locals())


@_model_builder("sdt", "3b", lora=True)
def lora_sdt_qwen2_5_3b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA SDT (Subjective Depth) Qwen2.5-3B (36 layers, d = 2048).

    LoRA twin of :func:`sdt_qwen2_5_3b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes SDT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("sdt", **QWEN2_5_SHAPES["3b"], **locals())


@_model_builder("sdt", "7b", lora=True)
def lora_sdt_qwen2_5_7b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA SDT (Subjective Depth) Qwen2.5-7B (28 layers, d = 3584).

    LoRA twin of :func:`sdt_qwen2_5_7b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes SDT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return lora_routed_qwen2("sdt", **QWEN2_5_SHAPES["7b"], **locals())


@_model_builder("sdt", "tiny", lora=True)
def lora_sdt_qwen2_5_tiny(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    vocab_size: int, max_seq_len: int,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA SDT (Subjective Depth) tiny Qwen2.5-shaped model (4 layers, d = 64).

    LoRA twin of :func:`sdt_qwen2_5_tiny`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes SDT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.sdt_routing` gives the shipped 0.5B configs' values).

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return lora_routed_qwen2("sdt", **QWEN2_5_SHAPES["tiny"], **locals())


@_model_builder("stt", "0_5b", lora=True)
def lora_stt_qwen2_5_0_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA STT (Subjective Timescale) Qwen2.5-0.5B (24 layers, d = 896).

    LoRA twin of :func:`stt_qwen2_5_0_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes STT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("stt", **QWEN2_5_SHAPES["0_5b"], **locals())


@_model_builder("stt", "1_5b", lora=True)
def lora_stt_qwen2_5_1_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA STT (Subjective Timescale) Qwen2.5-1.5B (28 layers, d = 1536).

    LoRA twin of :func:`stt_qwen2_5_1_5b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes STT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("stt", **QWEN2_5_SHAPES["1_5b"], **locals())


@_model_builder("stt", "3b", lora=True)
def lora_stt_qwen2_5_3b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA STT (Subjective Timescale) Qwen2.5-3B (36 layers, d = 2048).

    LoRA twin of :func:`stt_qwen2_5_3b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes STT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return lora_routed_qwen2("stt", **QWEN2_5_SHAPES["3b"], **locals())


@_model_builder("stt", "7b", lora=True)
def lora_stt_qwen2_5_7b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA STT (Subjective Timescale) Qwen2.5-7B (28 layers, d = 3584).

    LoRA twin of :func:`stt_qwen2_5_7b`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes STT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return lora_routed_qwen2("stt", **QWEN2_5_SHAPES["7b"], **locals())


@_model_builder("stt", "tiny", lora=True)
def lora_stt_qwen2_5_tiny(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int, lora_alpha: float, lora_dropout: float,
    vocab_size: int, max_seq_len: int,
    routed_layers: Placement, capacity: Capacity,
    student_routing_mode: str, student_threshold: Optional[float], student_window: Optional[int],
    causal_router_input: str, causal_router_hidden_dim: int, routing_init_std: float,
    gate: str, always_run_first_token: bool, allow_noncausal_student_topk: bool,
    skipped_tokens_write_kv: bool, skip_update: str, dropped_layers: Placement,
    prior_factor: float, ma_window: int, o_ce_init: float, m_cu_init: float,
    teacher_selection: str, gate_threshold: Optional[float],
) -> RoutedTransformerDecoder:
    """LoRA STT (Subjective Timescale) tiny Qwen2.5-shaped model (4 layers, d = 64).

    LoRA twin of :func:`stt_qwen2_5_tiny`; the LoRA arguments are those of :func:`lora_routed_qwen2`. It takes STT's
    routing arguments, all required and documented in :func:`routed_qwen2`
    (:func:`~torchtune_dtf.models.routing_presets.stt_routing` gives the shipped 0.5B configs' values).

    Args:
        vocab_size (int): rows of the embedding (the tokenizer's vocabulary size).
        max_seq_len (int): longest sequence the model takes (RoPE table, full KV cache).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    return lora_routed_qwen2("stt", **QWEN2_5_SHAPES["tiny"], **locals())
