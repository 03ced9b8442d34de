"""Routing presets: the complete routing arguments of the shipped Qwen2.5-0.5B configs, for Python users.

Configs list every routing value explicitly (there are no defaults in code). A script that builds a model
directly would otherwise copy 12 to 18 keys out of a YAML file; these functions return the same complete
keyword dict, optionally with some values changed. ``tests/test_builders.py`` checks that each preset equals
the ``model:`` routing values of ``configs/{mod,sdt,stt}_qwen0_5b.yaml`` and their LoRA twins (and, with
:data:`DEPLOYED_STUDENT`, of their eval and generate twins), so the presets and the configs cannot drift apart.

:func:`recommended_smollm2_routing` returns the study's recommended recipes for the quickstart model
(``configs/quickstart/recommended_*_smollm2.yaml`` and their eval and generate twins, checked the same way).

The variant presets are the shipped configs, not the papers' settings: they route ``every_other_inner`` (the papers:
``every_other``, which routes the last layer), always run the first token (papers: not), and SDT/STT use the
``straight_through`` gate (papers: ``scaled``); see the README.

Example:
    >>> from torchtune_dtf.models.qwen2_5 import mod_qwen2_5_1_5b, stt_qwen2_5_0_5b
    >>> from torchtune_dtf.models.routing_presets import mod_routing, stt_routing
    >>> stt = stt_qwen2_5_0_5b(**stt_routing())                # exactly configs/stt_qwen0_5b.yaml's model
    >>> mod = mod_qwen2_5_1_5b(**mod_routing(capacity=0.25))   # the MoD config at γ = 0.25, on 1.5B
"""

from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping

from torchtune_dtf.models.routing_config import REQUIRED_KEYS

# Values as in configs/mod_qwen0_5b.yaml; each key is documented in routed_qwen2's docstring.
_MOD = dict(
    routed_layers="every_other_inner",
    capacity=0.5,
    student_routing_mode="threshold",
    student_threshold=0.5,
    student_window=None,
    causal_router_input="current",
    causal_router_hidden_dim=256,
    routing_init_std=0.02,
    gate="scaled",  # MoD: σ(r) in training and inference alike
    always_run_first_token=True,
    allow_noncausal_student_topk=False,
    skipped_tokens_write_kv=False,
    skip_update="none",
    dropped_layers=[],
)
# configs/sdt_qwen0_5b.yaml: MoD's values with the straight-through gate, plus the surprise keys.
_SDT = dict(
    _MOD,
    gate="straight_through",
    prior_factor=0.0625,
    ma_window=100,
    o_ce_init=1.025,
    m_cu_init=1.1,
    teacher_selection="topk",
    gate_threshold=None,
)
# configs/stt_qwen0_5b.yaml: SDT's values with the two-token causal router, whose input is 2d wide, at half
# the hidden width (the same router FLOPs).
_STT = dict(_SDT, causal_router_input="current_previous", causal_router_hidden_dim=128)


def _preset(variant: str, values: Mapping[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(overrides) - set(REQUIRED_KEYS[variant]))
    if unknown:
        raise ValueError(f"unknown routing argument(s) for variant '{variant}': {', '.join(unknown)}")
    return {**values, **overrides}


def mod_routing(**overrides: Any) -> Dict[str, Any]:
    """The routing arguments of ``configs/mod_qwen0_5b.yaml``, with ``overrides`` applied.

    Args:
        **overrides: MoD routing arguments (see :func:`~torchtune_dtf.models.qwen2_5.routed_qwen2`) to change,
            e.g. ``capacity=0.25``.

    Returns:
        Dict[str, Any]: a new dict with every MoD routing argument, for ``mod_qwen2_5_*`` or
        ``routed_qwen2("mod", ...)``.

    Raises:
        ValueError: if an override is not a MoD routing argument (values are checked when the model is built).
    """
    return _preset("mod", _MOD, overrides)


def sdt_routing(**overrides: Any) -> Dict[str, Any]:
    """The routing arguments of ``configs/sdt_qwen0_5b.yaml``, with ``overrides`` applied.

    Args:
        **overrides: SDT routing arguments (see :func:`~torchtune_dtf.models.qwen2_5.routed_qwen2`) to change.

    Returns:
        Dict[str, Any]: a new dict with every SDT routing argument.

    Raises:
        ValueError: if an override is not an SDT routing argument.
    """
    return _preset("sdt", _SDT, overrides)


def stt_routing(**overrides: Any) -> Dict[str, Any]:
    """The routing arguments of ``configs/stt_qwen0_5b.yaml``, with ``overrides`` applied.

    Args:
        **overrides: STT routing arguments (see :func:`~torchtune_dtf.models.qwen2_5.routed_qwen2`) to change.

    Returns:
        Dict[str, Any]: a new dict with every STT routing argument.

    Raises:
        ValueError: if an override is not an STT routing argument.
    """
    return _preset("stt", _STT, overrides)


#: The student rule of the shipped eval and generate configs (``configs/{eval,generate}/``), which deploy the trained
#: causal router as a window top-k (it holds γ on generated text; the training configs validate and calibrate a
#: threshold student): ``stt_routing(**DEPLOYED_STUDENT)`` is ``configs/eval/stt_qwen0_5b.yaml``'s routing.
DEPLOYED_STUDENT: Mapping[str, Any] = MappingProxyType(
    dict(student_routing_mode="window_topk", student_threshold=None, student_window=64)
)

# The study's recommended recipes for the quickstart model (SmolLM2-135M shape, 30 layers), as
# configs/quickstart/recommended_{0_90,0_81,0_72}_smollm2.yaml train them: STT with whole layers dropped and the
# next ones routed with K/V kept, both chosen by `python -m torchtune_dtf.plan` on the quickstart's training text
# (the planner's first line in each config), a 64-wide two-token causal router, and the skip bias (≈ 0.90, ≈ 0.81)
# or the TPN's forecast (≈ 0.72) for skipped tokens. Layer indices are this model's: plan another model your own.
_RECOMMENDED_STT = dict(_STT, causal_router_hidden_dim=64, skipped_tokens_write_kv=True, skip_update="bias")
_RECOMMENDED_SMOLLM2 = {
    "0.90": dict(_RECOMMENDED_STT, routed_layers=(12, 16), capacity=0.625, dropped_layers=(14, 13, 17, 15)),
    "0.81": dict(_RECOMMENDED_STT, routed_layers=(16, 25, 26, 11, 18, 2), capacity=0.5,
                 dropped_layers=(14, 13, 17, 15, 12)),
    "0.72": dict(_RECOMMENDED_STT, routed_layers=(25, 26, 11, 18, 2, 4, 5, 10, 3, 9), capacity=0.5,
                 dropped_layers=(14, 13, 17, 15, 12, 16), skip_update="predicted"),
}
#: FLOP levels of the recommended recipes (closed-form forward FLOPs against dense, rounded).
RECOMMENDED_LEVELS = tuple(_RECOMMENDED_SMOLLM2)


def recommended_smollm2_routing(level: str, **overrides: Any) -> Dict[str, Any]:
    """The STT routing arguments of the study's recommended recipe at ``level`` for the quickstart model
    (``configs/quickstart/recommended_{level}_smollm2.yaml``), with ``overrides`` applied; with
    ``**DEPLOYED_STUDENT`` as overrides, those of its eval and generate twins.

    Args:
        level (str): ``"0.90"``, ``"0.81"`` or ``"0.72"`` (forward FLOPs against dense).
        **overrides: STT routing arguments to change.

    Returns:
        Dict[str, Any]: a new dict with every STT routing argument, for ``routed_qwen2("stt", ...)`` with the
        SmolLM2-135M architecture (the configs' ``model`` sections list it).

    Raises:
        ValueError: for an unknown level or an override that is not an STT routing argument.
    """
    if level not in _RECOMMENDED_SMOLLM2:
        raise ValueError(f"unknown recommended level {level!r}; known: {', '.join(RECOMMENDED_LEVELS)}")
    recipe = _RECOMMENDED_SMOLLM2[level]
    return _preset("stt", {**recipe, "routed_layers": list(recipe["routed_layers"]),
                           "dropped_layers": list(recipe["dropped_layers"])}, overrides)


#: Preset of each routed variant, by name.
ROUTING_PRESETS: Dict[str, Callable[..., Dict[str, Any]]] = {"mod": mod_routing, "sdt": sdt_routing, "stt": stt_routing}
