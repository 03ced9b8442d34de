"""Validation of routing hyperparameters (docs/design.md §3.10, spec §7).

There are no defaults in code: a builder receives every routing hyperparameter from its config, and
:func:`validate_routing` reports every missing, unknown or invalid value in one error before anything
is built.
"""

from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Dict, List, Optional, Sequence, Union

from torchtune_dtf.modules.layers import SKIP_UPDATES

VARIANTS = ("dense", "layerdrop", "random", "mod", "sdt", "stt")
#: Variants whose layers take no routing decision (the recipe trains them like the dense model).
STATIC_VARIANTS = ("dense", "layerdrop")

#: Keys every routed variant needs.
COMMON_KEYS = (
    "routed_layers",
    "capacity",
    "student_routing_mode",
    "student_threshold",
    "student_window",
    "causal_router_input",
    "causal_router_hidden_dim",
    "routing_init_std",
    "gate",
    "always_run_first_token",
    "allow_noncausal_student_topk",
    "skipped_tokens_write_kv",
    "skip_update",
    "dropped_layers",
)
#: How the trained causal router decides at inference (no weight depends on them): the keys an eval or generate
#: config may set apart from its training config.
STUDENT_RULE_KEYS = ("student_routing_mode", "student_threshold", "student_window")
#: ``routed_layers`` / ``dropped_layers``: a name from ``PLACEMENTS`` or a list of layer indices.
Placement = Union[str, List[int]]
#: ``capacity``: one γ for every routed layer, or one γ per routed layer in the order ``routed_layers`` lists them.
Capacity = Union[float, List[float]]

#: Named placements of ``routed_layers`` (a list of indices is the alternative).
PLACEMENTS = {
    # 1, 3, 5, …: the papers' placement; with an even number of layers the last layer is routed.
    "every_other": lambda n: list(range(1, n, 2)),
    # 1, 3, …, but never the last layer: first and last layers dense. The last layer's update is
    # 100–1000× larger than the others', and a token that skips it is unembedded from an unfinished state.
    "every_other_inner": lambda n: list(range(1, n - 1, 2)),
}
#: Extra keys of the surprise-routed variants (SDT, STT).
SURPRISE_KEYS = ("prior_factor", "ma_window", "o_ce_init", "m_cu_init", "teacher_selection", "gate_threshold")

#: Random routing (a baseline): the same budget and execution as the routed variants, no router; it may drop
#: layers and give skipped tokens a learned constant update as they can (so it can take a routed recipe's shape).
RANDOM_KEYS = ("routed_layers", "capacity", "always_run_first_token", "skipped_tokens_write_kv", "skip_update",
               "dropped_layers")

REQUIRED_KEYS = {
    "dense": (),
    # Static layer dropping (a baseline): the listed layers run on no token (their weights stay loaded);
    # with skip_update "bias" / "linear" every token receives each dropped layer's learned constant update / affine
    # map of its input instead.
    "layerdrop": ("dropped_layers", "skip_update"),
    "random": RANDOM_KEYS,
    "mod": COMMON_KEYS,
    "sdt": COMMON_KEYS + SURPRISE_KEYS,
    "stt": COMMON_KEYS + SURPRISE_KEYS,
}


#: Routing keys made required after runs had saved configs and checkpoints without them, each with the value
#: that computes what such a run computed: a saved config that lacks one loads with it (:func:`with_keys_added_later`),
#: and the recipe resumes such a checkpoint while the config holds that value.
KEYS_ADDED_LATER: Dict[str, Any] = {"dropped_layers": [], "skip_update": "none", "student_window": None}


def with_keys_added_later(model_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A saved ``model`` section (``variant`` given) completed with the :data:`KEYS_ADDED_LATER` its variant
    requires but the config predates; every other config is returned unchanged (as a new dict)."""
    cfg = dict(model_cfg)
    required = REQUIRED_KEYS.get(cfg.get("variant"), ())
    for key, value in KEYS_ADDED_LATER.items():
        if key in required and key not in cfg:
            cfg[key] = value
    return cfg


@dataclass(frozen=True)
class RoutingSpec:
    """Validated routing hyperparameters of one model (see :func:`validate_routing`).

    ``routed_layers`` is resolved to explicit indices and ``capacity`` to one γ per routed layer.
    """

    variant: str
    routed_layers: List[int]
    capacity: List[float]
    student_routing_mode: Optional[str] = None
    student_threshold: Optional[float] = None
    student_window: Optional[int] = None
    causal_router_input: Optional[str] = None
    causal_router_hidden_dim: Optional[int] = None
    routing_init_std: Optional[float] = None
    prior_factor: Optional[float] = None
    ma_window: Optional[int] = None
    o_ce_init: Optional[float] = None
    m_cu_init: Optional[float] = None
    teacher_selection: Optional[str] = None
    gate_threshold: Optional[float] = None
    gate: Optional[str] = None
    always_run_first_token: Optional[bool] = None
    allow_noncausal_student_topk: Optional[bool] = None
    skipped_tokens_write_kv: Optional[bool] = None
    skip_update: Optional[str] = None
    dropped_layers: List[int] = field(default_factory=list)  # layerdrop, or whole layers a routed model drops


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _resolve_layers(
    value: Union[str, Sequence[int]], num_layers: int, problems: List[str], key: str = "routed_layers"
) -> List[int]:
    if isinstance(value, str) and value in PLACEMENTS:
        return PLACEMENTS[value](num_layers)
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(_is_int(i) for i in value):
        problems.append(f"{key} must be one of {sorted(PLACEMENTS)} or a list of layer indices, got {value!r}")
        return []
    layers = sorted(int(i) for i in value)
    if len(set(layers)) != len(layers):
        problems.append(f"{key} has duplicates: {list(value)}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        problems.append(f"{key} {bad} are outside [0, {num_layers})")
    return layers


def _resolve_dropped(routing: Dict[str, Any], num_layers: int, problems: List[str]) -> List[int]:
    """``dropped_layers`` resolved (``[]`` when absent), with the check every variant that drops layers shares."""
    if "dropped_layers" not in routing:
        return []
    dropped = _resolve_layers(routing["dropped_layers"], num_layers, problems, key="dropped_layers")
    if len(dropped) == num_layers:
        problems.append("dropped_layers drops every layer")
    return dropped


def capacity_per_layer(routed_layers: Placement, layers: Sequence[int], capacities: Sequence[float]) -> List[float]:
    """One γ per layer of ``layers`` (the resolved, sorted placement) from ``capacities``, which lists one γ per
    layer in the order the config's ``routed_layers`` lists them, not in index order: a placement written in any
    order (e.g. by block influence) keeps each layer's own capacity. The builder and the closed-form FLOPs both
    pair them here."""
    listed = list(layers) if isinstance(routed_layers, str) else [int(i) for i in routed_layers]
    capacity_of = dict(zip(listed, capacities))
    return [float(capacity_of[i]) for i in layers]


def validate_routing(variant: str, num_layers: int, *, for_builder: bool = True, **routing: Any) -> RoutingSpec:
    """Check a variant's routing hyperparameters and resolve them.

    Args:
        variant (str): one of ``VARIANTS``.
        num_layers (int): number of decoder layers of the model.
        for_builder (bool): True checks what a builder needs: every key present, and only combinations it can
            build. False resolves what the closed-form FLOPs read: a partial set (keys the cost does not depend on
            may be absent; the spec holds None for them), and shapes the builder refuses but the cost is defined
            for (a planner candidate that routes no layer, a forecast on a variant without one, an SDT layer without
            its Decision layer); every value given is still checked.
        **routing: the hyperparameters (see ``REQUIRED_KEYS``).

    Returns:
        RoutingSpec: the resolved specification.

    Raises:
        ValueError: listing every problem found (unknown variant, missing or unknown keys, invalid values).
    """
    if variant not in VARIANTS:
        raise ValueError(f"Invalid routing configuration:\n  - unknown variant {variant!r}; expected one of {VARIANTS}")
    required = REQUIRED_KEYS[variant]
    problems: List[str] = []
    missing = [key for key in required if key not in routing]
    if missing and for_builder:
        problems.append(f"missing required routing hyperparameter(s) for variant '{variant}': {', '.join(missing)}")
    unknown = sorted(set(routing) - set(required))
    if unknown:
        problems.append(f"unknown routing hyperparameter(s) for variant '{variant}': {', '.join(unknown)}")
    if variant in STATIC_VARIANTS:
        dropped = _resolve_dropped(routing, num_layers, problems) if variant == "layerdrop" else []
        if variant == "layerdrop" and "dropped_layers" in routing and not dropped and not problems and for_builder:
            problems.append("dropped_layers resolves to no layer; use variant 'dense' for a dense model")
        skip_update = routing.get("skip_update")
        if variant == "layerdrop" and "skip_update" in routing and skip_update not in ("none", "bias", "linear"):
            problems.append(f"layerdrop's skip_update must be 'none', 'bias' or 'linear' (a dropped layer has no forecast), "
                            f"got {skip_update!r}")
        if problems:
            raise ValueError("Invalid routing configuration:\n  - " + "\n  - ".join(problems))
        return RoutingSpec(variant=variant, routed_layers=[], capacity=[], dropped_layers=dropped,
                           skip_update=skip_update)

    values: Dict[str, Any] = {key: routing.get(key) for key in required}
    layers = _resolve_layers(values["routed_layers"], num_layers, problems) if "routed_layers" in routing else []
    if variant == "sdt" and for_builder:
        for i in layers:
            if i == 0 or (i - 1) in layers:
                problems.append(
                    f"SDT routed layer {i} needs a Decision layer before it (layer {i - 1} must exist and not be routed)"
                )

    capacity = values["capacity"]
    capacities: List[float] = []
    if "capacity" in routing:
        as_list = list(capacity) if isinstance(capacity, Sequence) and not isinstance(capacity, str) else [capacity]
        if not all(_is_real(c) and 0 < c <= 1 for c in as_list):
            problems.append(f"capacity must be in (0, 1] (one value, or one per routed layer), got {capacity!r}")
        elif len(as_list) == 1:
            capacities = [float(as_list[0])] * len(layers)
        elif len(as_list) != len(layers):
            problems.append(f"capacity lists {len(as_list)} values but there are {len(layers)} routed layers")
        elif not problems:
            capacities = capacity_per_layer(routing.get("routed_layers", layers), layers, as_list)

    mode = values.get("student_routing_mode")
    if "student_routing_mode" in routing and mode not in ("threshold", "topk", "window_topk"):
        problems.append(f"unknown student_routing_mode {mode!r}; expected 'threshold', 'topk' or 'window_topk'")
    threshold = values.get("student_threshold")
    if mode == "threshold" and "student_threshold" in routing and not (_is_real(threshold) and 0 <= threshold < 1):
        problems.append(f"student_threshold must be in [0, 1) for threshold routing, got {threshold!r}")
    width = values.get("student_window")
    if mode == "window_topk" and "student_window" in routing and not (_is_int(width) and width >= 2):
        problems.append(f"student_window must be an integer ≥ 2 (tokens) for window_topk routing, got {width!r}")
    if "causal_router_input" in routing and routing["causal_router_input"] not in ("current", "current_previous"):
        problems.append(
            f"unknown causal_router_input {routing['causal_router_input']!r}; expected 'current' or 'current_previous'"
        )
    hidden = values.get("causal_router_hidden_dim")
    if "causal_router_hidden_dim" in routing and not (_is_int(hidden) and hidden > 0):
        problems.append(f"causal_router_hidden_dim must be a positive integer, got {hidden!r}")
    std = values.get("routing_init_std")
    if "routing_init_std" in routing and not (_is_real(std) and std > 0):
        problems.append(f"routing_init_std must be positive, got {std!r}")
    if "gate" in routing and routing["gate"] not in ("scaled", "straight_through"):
        problems.append(f"unknown gate {routing['gate']!r}; expected 'scaled' or 'straight_through'")
    for key in ("always_run_first_token", "allow_noncausal_student_topk", "skipped_tokens_write_kv"):
        if key in routing and not isinstance(routing[key], bool):
            problems.append(f"{key} must be True or False, got {routing[key]!r}")
    if "skip_update" in routing:
        if routing["skip_update"] not in SKIP_UPDATES:
            problems.append(f"unknown skip_update {routing['skip_update']!r}; expected one of {SKIP_UPDATES}")
        elif routing["skip_update"] == "predicted" and variant != "stt" and for_builder:
            problems.append(
                f"skip_update: predicted needs a forecast of the block's own update (the STT transition network); "
                f"variant '{variant}' has none (SDT's PriorFFN predicts the Decision layer's update), use 'none'"
            )
    # A routed model may also drop whole layers (static layer dropping on the layers no token needs, routing
    # on the marginal ones): a dropped layer runs on no token and pays no router or K/V projection.
    dropped = _resolve_dropped(routing, num_layers, problems)
    both = sorted(set(dropped) & set(layers))
    if both:
        problems.append(f"layers {both} are both routed and dropped; a layer is one or the other")
    needed = sorted({i - 1 for i in layers} & set(dropped)) if variant == "sdt" and for_builder else []
    if needed:
        problems.append(f"SDT Decision layer(s) {needed} (the layer before a routed one) cannot be dropped")
    if layers == [] and "routed_layers" in routing and not problems and for_builder:
        problems.append(f"routed_layers resolves to no layer for variant '{variant}'; use variant 'dense' for a dense model")

    if variant in ("sdt", "stt"):
        factor = values["prior_factor"]
        if "prior_factor" in routing and not (_is_real(factor) and 0 < factor <= 1):
            problems.append(f"prior_factor must be in (0, 1], got {factor!r}")
        window = values["ma_window"]
        if "ma_window" in routing and not (_is_int(window) and window >= 1):
            problems.append(f"ma_window must be a positive integer (tokens), got {window!r}")
        for key in ("o_ce_init", "m_cu_init"):
            if key in routing and not (_is_real(values[key]) and values[key] > 0):
                problems.append(f"{key} must be positive, got {values[key]!r}")
        selection = values["teacher_selection"]
        if "teacher_selection" in routing and selection not in ("topk", "threshold"):
            problems.append(f"unknown teacher_selection {selection!r}; expected 'topk' or 'threshold'")
        g_th = values["gate_threshold"]
        if selection == "threshold" and "gate_threshold" in routing and not (_is_real(g_th) and 0 < g_th < 1):
            problems.append(f"gate_threshold must be in (0, 1) for threshold selection, got {g_th!r}")

    if problems:
        raise ValueError("Invalid routing configuration:\n  - " + "\n  - ".join(problems))
    values.update(routed_layers=layers, capacity=capacities, dropped_layers=dropped)
    return RoutingSpec(variant=variant, **values)
