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
(``tests/test_builders.py`` checks every signature against ``REQUIRED_KEYS``). ``@_reports_every_problem``
keeps the project's promise of one error listing every missing, unknown and invalid routing argument, where
Python alone would stop at the first unknown keyword.

The architecture numbers are Qwen2.5's (as torchtune's builders; 1.5B and 7B with the base models' 131072
``max_seq_len``). ``tiny`` is a shape for tests and CPU smoke runs; its builders also require ``vocab_size``
(to match the tokenizer of the checkpoint) and ``max_seq_len``, which no default could know.

Example:
    >>> from torchtune_dtf.models.qwen2_5 import stt_qwen2_5_0_5b
    >>> from torchtune_dtf.models.routing_presets import stt_routing
    >>> model = stt_qwen2_5_0_5b(**stt_routing(capacity=0.25))  # the shipped config at γ = 0.25
"""

import functools
import importlib
import inspect
from types import MappingProxyType
from typing import Any, Callable, List, Mapping, Optional

from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_dtf.models.qwen2_5._component_builders import lora_routed_qwen2, routed_qwen2
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


def _reports_every_problem(builder: Callable[..., RoutedTransformerDecoder]) -> Callable[..., RoutedTransformerDecoder]:
    """Report arguments that do not fit ``builder``'s signature as :func:`validate_routing` does.

    Python's TypeError names the first unknown keyword and stops; a call that does not bind is instead checked
    by :func:`validate_routing`, whose ValueError lists every missing, unknown and invalid routing argument
    (the TypeError stays attached as its cause; when the routing arguments are fine, e.g. a LoRA argument is
    missing, the TypeError is Python's). Name, docstring and ``inspect.signature`` are the builder's.
    """
    variant = builder.__name__.removeprefix("lora_").split("_", 1)[0]
    num_layers = QWEN2_5_SHAPES[builder.__name__.split("_qwen2_5_", 1)[1]]["num_layers"]
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

    return build


@_reports_every_problem
def dense_qwen2_5_0_5b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-0.5B (24 layers, d = 896).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["0_5b"])


@_reports_every_problem
def dense_qwen2_5_1_5b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-1.5B (28 layers, d = 1536).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["1_5b"])


@_reports_every_problem
def dense_qwen2_5_3b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-3B (36 layers, d = 2048).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 151936]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["3b"])


@_reports_every_problem
def dense_qwen2_5_7b() -> RoutedTransformerDecoder:
    """Dense Qwen2.5-7B (28 layers, d = 3584).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, 152064]``.
    """
    return routed_qwen2("dense", **QWEN2_5_SHAPES["7b"])


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


@_reports_every_problem
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


LORA_ARGUMENTS = ("lora_attn_modules", "apply_lora_to_mlp", "lora_rank", "lora_alpha", "lora_dropout")


def merged_model_config(model_cfg: Mapping[str, Any]) -> dict:
    """The model config that a LoRA run's saved checkpoint loads into: the builder's non-LoRA twin.

    The recipe saves LoRA merged into copies of the base weights, as torchtune's LoRA recipes do, so a saved
    ``epoch_N`` holds no ``lora_a``/``lora_b`` weights and loads, strictly, into the twin without LoRA
    (``lora_stt_qwen2_5_0_5b`` → ``stt_qwen2_5_0_5b``, ``lora_routed_qwen2`` → ``routed_qwen2``), the model the
    shipped ``configs/eval/lora_*`` configs name. The routing arguments carry over unchanged; the LoRA ones
    (``LORA_ARGUMENTS``) are dropped. A config without a LoRA builder is returned as it is (as a plain dict).

    Args:
        model_cfg (Mapping[str, Any]): a config's ``model`` section, ``_component_`` included.

    Returns:
        dict: the twin's ``model`` section.

    Raises:
        ValueError: if ``model_cfg`` names a ``lora_*`` builder whose twin does not exist.
    """
    cfg = dict(model_cfg)
    module_name, _, builder = str(cfg["_component_"]).rpartition(".")
    if not builder.startswith("lora_"):
        return cfg
    twin = builder[len("lora_"):]
    if not hasattr(importlib.import_module(module_name), twin):
        raise ValueError(f"{cfg['_component_']} is a LoRA builder, but {module_name} has no non-LoRA twin {twin!r} "
                         "to load its merged checkpoint into")
    merged = {key: value for key, value in cfg.items() if key not in LORA_ARGUMENTS}
    merged["_component_"] = f"{module_name}.{twin}"
    return merged


#: Every key that routes (any variant's); none of them is an architecture or LoRA argument.
_ALL_ROUTING_KEYS = frozenset(key for keys in REQUIRED_KEYS.values() for key in keys)


def dense_model_config(model_cfg: Mapping[str, Any]) -> dict:
    """The model config of the dense model with the same architecture (and LoRA settings): every routing key
    removed, ``variant: dense`` for the component builders or the ``dense_`` builder of the same size.

    Every layer of that model runs every token, dropped and routed layers alike: the distillation teacher and the
    layer planner's base model (its block influence) are this model on the starting weights.

    Args:
        model_cfg (Mapping[str, Any]): a config's ``model`` section, ``_component_`` included.

    Returns:
        dict: the dense model's ``model`` section.
    """
    dense = {key: value for key, value in dict(model_cfg).items() if key not in _ALL_ROUTING_KEYS}
    if "variant" in dense:
        dense["variant"] = "dense"
        return dense
    module_name, _, builder = str(dense["_component_"]).rpartition(".")
    lora = builder.startswith("lora_")
    size = builder.removeprefix("lora_").split("_", 1)[1]
    dense["_component_"] = f"{module_name}.{'lora_' if lora else ''}dense_{size}"
    return dense
