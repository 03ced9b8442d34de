"""A config's ``model`` section, read in one place.

Every workflow needs to know things about the model a config describes before (or without) building it: which
variant it is and whether it has LoRA adapters (the recipe's checks), its architecture and routing arguments (the
closed-form FLOPs, the planner), the model its merged LoRA checkpoint loads into (eval, reports, studies) and the
dense model of the same shape (the distillation teacher, the planner's block influence). They are all read here,
from the section's keys and from what its builder declares (``identity``, set where each builder is defined in
:mod:`torchtune_dtf.models.qwen2_5`), never from a builder's name.

A ``model`` section is a mapping with ``_component_`` (a builder's dotted path) and the builder's arguments:

- a component builder (``routed_qwen2`` / ``lora_routed_qwen2``): ``variant`` and the architecture key by key;
- a model builder (``stt_qwen2_5_0_5b``, ``lora_mod_qwen2_5_tiny``, …): the variant and size are the builder's.
"""

from typing import Any, Callable, Dict, Mapping

from torchtune.config._utils import _get_component_from_path

from torchtune_dtf.models.qwen2_5._component_builders import (
    ARCHITECTURE_KEYS,
    BuilderIdentity,
    lora_routed_qwen2,
    routed_qwen2,
)
from torchtune_dtf.models.qwen2_5._model_builders import MODEL_BUILDERS, QWEN2_5_SHAPES
from torchtune_dtf.models.routing_config import REQUIRED_KEYS

#: Keys of a model section that say which builder and architecture it is (not how it routes).
ARCH_KEYS = ("_component_", "variant") + ARCHITECTURE_KEYS
#: The LoRA arguments of the LoRA builders (torchtune's names); a merged checkpoint's model takes none of them.
LORA_ARGUMENTS = ("lora_attn_modules", "apply_lora_to_mlp", "lora_rank", "lora_alpha", "lora_dropout")
#: Every key that routes (any variant's); none of them is an architecture or LoRA argument.
ROUTING_KEYS = frozenset(key for keys in REQUIRED_KEYS.values() for key in keys)


def builder_of(model_cfg: Mapping[str, Any]) -> Callable[..., Any]:
    """The builder ``model_cfg["_component_"]`` names.

    Raises:
        ValueError: if the section has no ``_component_`` or it cannot be imported.
    """
    if "_component_" not in model_cfg:
        raise ValueError(f"a model section needs `_component_` (a builder's dotted path), got keys {sorted(model_cfg)}")
    try:
        return _get_component_from_path(str(model_cfg["_component_"]))
    except Exception as err:  # torchtune raises InstantiationError (or ImportError) with the path in its message
        raise ValueError(f"model._component_ {model_cfg['_component_']!r} cannot be imported: {err}") from err


def builder_identity(model_cfg: Mapping[str, Any]) -> BuilderIdentity:
    """What the section's builder builds (:class:`BuilderIdentity`).

    Raises:
        ValueError: if the builder is not one of this package's (it declares no ``identity``).
    """
    identity = getattr(builder_of(model_cfg), "identity", None)
    if not isinstance(identity, BuilderIdentity):
        raise ValueError(
            f"model._component_ {model_cfg['_component_']!r} is not a torchtune_dtf model builder: use "
            "torchtune_dtf.models.qwen2_5.routed_qwen2 (or lora_routed_qwen2) with `variant`, or a "
            "{variant}_qwen2_5_{size} builder"
        )
    return identity


def model_variant(model_cfg: Mapping[str, Any]) -> str:
    """The variant the section builds: its ``variant`` argument (component builders), else its builder's."""
    if model_cfg.get("variant") is not None:
        return str(model_cfg["variant"])
    variant = builder_identity(model_cfg).variant
    if variant is None:
        raise ValueError(f"model._component_ {model_cfg['_component_']} takes the variant as an argument; "
                         "the model section has no `variant`")
    return variant


def is_lora(model_cfg: Mapping[str, Any]) -> bool:
    """Whether the section's builder adds LoRA adapters."""
    return builder_identity(model_cfg).lora


def architecture(model_cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """The architecture (the fields of ``Qwen2Architecture``) of the section: its own keys for a component
    builder, else its builder's size in ``QWEN2_5_SHAPES`` with the section's ``vocab_size`` / ``max_seq_len``
    where it gives them (the tiny builders require both)."""
    if "num_layers" in model_cfg:
        return {key: model_cfg[key] for key in ARCHITECTURE_KEYS if key in model_cfg}
    size = builder_identity(model_cfg).size
    if size is None:
        raise ValueError(f"model._component_ {model_cfg['_component_']} takes the architecture as arguments; "
                         "the model section has no `num_layers`")
    shape = dict(QWEN2_5_SHAPES[size])
    shape.update({key: model_cfg[key] for key in ("vocab_size", "max_seq_len") if model_cfg.get(key) is not None})
    return shape


def routing_arguments(model_cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """The section's routing arguments: the keys the variant's routing takes (``REQUIRED_KEYS``), as given;
    architecture, LoRA and other keys left out."""
    wanted = REQUIRED_KEYS[model_variant(model_cfg)]
    return {key: model_cfg[key] for key in wanted if key in model_cfg}


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
        ValueError: if ``_component_`` is not a builder of this package.
    """
    cfg = dict(model_cfg)
    try:
        identity = builder_identity(cfg)
    except ValueError as err:
        builder = str(cfg.get("_component_", "")).rpartition(".")[2]
        raise ValueError(f"{cfg.get('_component_')!r} is not a model builder of this package, so it has no non-LoRA "
                         f"twin {builder.removeprefix('lora_')!r} to load a merged checkpoint into ({err})") from err
    if not identity.lora:
        return cfg
    merged = {key: value for key, value in cfg.items() if key not in LORA_ARGUMENTS}
    merged["_component_"] = _twin_path(cfg, identity.variant, identity.size, lora=False)
    return merged


def dense_model_config(model_cfg: Mapping[str, Any]) -> dict:
    """The model config of the dense model with the same architecture (and LoRA settings): every routing key
    removed, ``variant: dense`` for the component builders or the dense builder of the same size.

    Every layer of that model runs every token, dropped and routed layers alike: the distillation teacher and the
    layer planner's base model (its block influence) are this model on the starting weights.

    Args:
        model_cfg (Mapping[str, Any]): a config's ``model`` section, ``_component_`` included.

    Returns:
        dict: the dense model's ``model`` section.
    """
    dense = {key: value for key, value in dict(model_cfg).items() if key not in ROUTING_KEYS}
    identity = builder_identity(dense)
    if identity.variant is None:
        dense["variant"] = "dense"
    else:
        dense["_component_"] = _twin_path(dense, "dense", identity.size, lora=identity.lora)
    return dense


def _twin_path(model_cfg: Mapping[str, Any], variant: Any, size: Any, *, lora: bool) -> str:
    """Dotted path of the builder of ``(variant, size, lora)``, in the module the section's path names (so a
    config that imports from ``torchtune_dtf.models.qwen2_5`` keeps doing so)."""
    if variant is None:  # a component builder: its twin is the other component builder
        twin = lora_routed_qwen2 if lora else routed_qwen2
    else:
        twin = MODEL_BUILDERS[(variant, size, lora)]
    module_name = str(model_cfg["_component_"]).rpartition(".")[0]
    return f"{module_name}.{twin.__name__}"
