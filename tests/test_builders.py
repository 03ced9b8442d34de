"""torchtune_dtf.models.qwen2_5.{_model_builders, _component_builders}, torchtune_dtf.models.routing_presets: the
builders as torchtune's: one ``def`` per model builder, inspectable signatures, one architecture definition, and
routing presets that equal the shipped configs."""

import dataclasses
import inspect
import itertools
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.config._utils import _get_component_from_path

from torchtune_dtf.models import qwen2_5
from torchtune_dtf.models.qwen2_5 import _component_builders, _model_builders
from torchtune_dtf.models.routing_config import REQUIRED_KEYS, validate_routing
from torchtune_dtf.models.routing_presets import (
    DEPLOYED_STUDENT,
    ROUTING_PRESETS,
    mod_routing,
    recommended_smollm2_routing,
    sdt_routing,
    stt_routing,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
VARIANTS = ("dense", "mod", "sdt", "stt")
SIZES = ("0_5b", "1_5b", "3b", "7b", "tiny")
BUILDERS = [f"{lora}{variant}_qwen2_5_{size}" for lora, variant, size in itertools.product(("", "lora_"), VARIANTS, SIZES)]
LORA_KEYWORDS = ("lora_rank", "lora_alpha", "lora_dropout")
TINY_KEYWORDS = ("vocab_size", "max_seq_len")


def _model_components():
    """(config, ``_component_``, model arguments) of every shipped config's model section."""
    found = []
    for path in CONFIGS:
        cfg = OmegaConf.load(path)
        model = cfg.get("model")
        if model is not None and str(model.get("_component_", "")).startswith("torchtune_dtf.models."):
            args = OmegaConf.to_container(model, resolve=True)
            found.append((path.relative_to(REPO).as_posix(), args.pop("_component_"), args))
    return found


MODEL_COMPONENTS = _model_components()


def test_at_least_40_shipped_configs_name_a_package_model_builder():
    assert len(MODEL_COMPONENTS) >= 40  # configs/, eval/, generate/, quickstart/, tiny/


@pytest.mark.parametrize("config, component, args", MODEL_COMPONENTS, ids=[c for c, _, _ in MODEL_COMPONENTS])
def test_every_config_component_is_a_plain_inspectable_def(config, component, args):
    fn = _get_component_from_path(component)
    name = component.rsplit(".", 1)[-1]
    module = _component_builders if name in ("routed_qwen2", "lora_routed_qwen2") else _model_builders
    definition = inspect.unwrap(fn)
    # a `def` of that name in the builders module (grep finds it), not a generated closure
    assert fn.__name__ == definition.__name__ == definition.__code__.co_name == name
    assert definition.__code__.co_filename == module.__file__
    assert f"\ndef {name}(" in Path(module.__file__).read_text(encoding="utf-8")
    assert inspect.getdoc(fn) and len(inspect.getdoc(fn)) > 40
    # the config's arguments fit the signature (the model is not built: 0.5B configs would take seconds)
    inspect.signature(fn).bind(**args)


def test_all_lists_every_builder_explicitly():
    assert set(BUILDERS) <= set(qwen2_5.__all__)
    assert {"routed_qwen2", "lora_routed_qwen2", "Qwen2Architecture", "QWEN2_5_SHAPES"} <= set(qwen2_5.__all__)
    assert all(hasattr(qwen2_5, name) for name in qwen2_5.__all__)
    assert "import *" not in Path(qwen2_5.__file__).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", BUILDERS)
def test_builder_signature_lists_exactly_its_arguments(name):
    lora = name.startswith("lora_")
    variant = name.removeprefix("lora_").split("_", 1)[0]
    fn = getattr(qwen2_5, name)
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert positional == (["lora_attn_modules", "apply_lora_to_mlp"] if lora else [])
    expected = (LORA_KEYWORDS if lora else ()) + (TINY_KEYWORDS if name.endswith("_tiny") else ()) + REQUIRED_KEYS[variant]
    assert tuple(keyword) == expected
    # every argument is required (no defaults in code) and annotated; no **kwargs catch-all
    assert all(p.default is inspect.Parameter.empty and p.annotation is not inspect.Parameter.empty for p in params)
    assert inspect.signature(fn).return_annotation.__name__ == "RoutedTransformerDecoder"
    if variant != "dense":
        assert "routed_qwen2" in fn.__doc__ and f"{variant}_routing" in fn.__doc__


@pytest.mark.parametrize("name", BUILDERS)
def test_builder_passes_each_argument_to_its_own_key(name, monkeypatch):
    """``**locals()`` in the body: every argument arrives under its own name, with the size's architecture."""
    lora = name.startswith("lora_")
    variant, size = name.removeprefix("lora_").split("_", 1)[0], name.split("_qwen2_5_", 1)[1]
    calls = []
    monkeypatch.setattr(_model_builders, "lora_routed_qwen2" if lora else "routed_qwen2",
                        lambda *args, **kwargs: calls.append((args, kwargs)))
    params = inspect.signature(getattr(qwen2_5, name)).parameters
    values = {key: f"<{key}>" for key in params}  # distinct per argument; nothing is validated here
    getattr(qwen2_5, name)(**values)
    (args, kwargs), = calls
    assert args == (variant,)
    assert kwargs == {**_model_builders.QWEN2_5_SHAPES[size], **values}


def test_builders_report_every_routing_problem_at_once():
    routing = dict(stt_routing(capacity=1.5, ma_window=0), prior_factr=0.1)
    del routing["m_cu_init"]
    with pytest.raises(ValueError) as err:  # Python alone would stop at the unknown keyword
        qwen2_5.stt_qwen2_5_tiny(vocab_size=512, max_seq_len=256, **routing)
    for fragment in ("missing required routing hyperparameter(s) for variant 'stt': m_cu_init", "prior_factr",
                     "capacity must be in (0, 1]", "ma_window must be a positive integer"):
        assert fragment in str(err.value)
    assert isinstance(err.value.__cause__, TypeError)
    with pytest.raises(ValueError, match="unknown routing hyperparameter.*'dense': capacity"):
        qwen2_5.dense_qwen2_5_0_5b(capacity=0.5)
    # a routing-valid call missing LoRA arguments: Python's TypeError, naming the builder and the arguments
    with pytest.raises(TypeError, match=r"lora_stt_qwen2_5_tiny\(\) missing 2 .*'lora_alpha' and 'lora_dropout'"):
        qwen2_5.lora_stt_qwen2_5_tiny(["q_proj"], True, lora_rank=2, vocab_size=512, max_seq_len=256, **stt_routing())


def test_tiny_builders_require_vocab_size_and_max_seq_len():
    for variant in VARIANTS:
        routing = ROUTING_PRESETS[variant]() if variant != "dense" else {}
        with pytest.raises(TypeError, match="missing 2 required keyword-only arguments: 'vocab_size' and 'max_seq_len'"):
            getattr(qwen2_5, f"{variant}_qwen2_5_tiny")(**routing)
    model = qwen2_5.stt_qwen2_5_tiny(vocab_size=100, max_seq_len=32, **stt_routing())
    assert model.tok_embeddings.num_embeddings == 100 and model.max_seq_len == 32


# ------------------------------------------------------------------------------------------ architecture
def test_architecture_arguments_are_defined_once():
    fields = tuple(f.name for f in dataclasses.fields(qwen2_5.Qwen2Architecture))
    assert qwen2_5.ARCHITECTURE_KEYS == fields
    for fn, extra in ((qwen2_5.routed_qwen2, ()), (qwen2_5.lora_routed_qwen2, LORA_KEYWORDS)):
        params = inspect.signature(fn).parameters.values()
        keyword = tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        assert keyword == extra + fields  # the flat YAML keywords are exactly the dataclass fields
        assert [p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD] == ["routing"]
    for size, shape in qwen2_5.QWEN2_5_SHAPES.items():
        assert set(shape) == set(fields) - (set(TINY_KEYWORDS) if size == "tiny" else set()), size
        if size != "tiny":
            arch = qwen2_5.Qwen2Architecture(**shape)
            assert arch.head_dim * arch.num_heads == arch.embed_dim
    with pytest.raises(TypeError):  # shared by every build: read-only
        qwen2_5.QWEN2_5_SHAPES["tiny"]["num_layers"] = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        qwen2_5.Qwen2Architecture(**qwen2_5.QWEN2_5_SHAPES["0_5b"]).num_layers = 2


def test_component_builders_take_flat_keywords_as_the_configs_do():
    """The quickstart configs call routed_qwen2 / lora_routed_qwen2 with flat architecture keywords."""
    import torch
    from torchtune import config

    for name in ("stt_smollm2.yaml", "lora_stt_smollm2.yaml", "layerdrop_smollm2.yaml", "random_smollm2.yaml"):
        model_cfg = OmegaConf.load(REPO / "configs" / "quickstart" / name).model
        with torch.device("meta"):
            model = config.instantiate(model_cfg)
        assert len(model.layers) == model_cfg.num_layers == 30
        assert model.tok_embeddings.num_embeddings == model_cfg.vocab_size


# ------------------------------------------------------------------------------------------ presets
PRESET_CONFIGS = [
    (variant, path)
    for variant in ("mod", "sdt", "stt")
    for path in (f"{variant}_qwen0_5b.yaml", f"lora_{variant}_qwen0_5b.yaml", f"eval/{variant}_qwen0_5b.yaml",
                 f"eval/lora_{variant}_qwen0_5b.yaml", f"generate/{variant}_qwen0_5b.yaml",
                 f"generate/lora_{variant}_qwen0_5b.yaml")
]


@pytest.mark.parametrize("variant, path", PRESET_CONFIGS, ids=[p for _, p in PRESET_CONFIGS])
def test_presets_equal_the_shipped_configs(variant, path):
    model = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / path).model, resolve=True)
    routing = {key: value for key, value in model.items() if key in REQUIRED_KEYS[variant]}
    assert set(routing) == set(REQUIRED_KEYS[variant])  # the config carries every value explicitly
    deployed = path.startswith(("eval/", "generate/"))  # inference configs deploy the window top-k student
    assert ROUTING_PRESETS[variant](**(DEPLOYED_STUDENT if deployed else {})) == routing


def test_presets_are_complete_fresh_and_checked():
    for variant, preset in ROUTING_PRESETS.items():
        assert tuple(preset()) == REQUIRED_KEYS[variant]
        validate_routing(variant, qwen2_5.QWEN2_5_SHAPES["0_5b"]["num_layers"], **preset())
    changed = stt_routing(capacity=0.25, teacher_selection="threshold", gate_threshold=0.9)
    assert (changed["capacity"], changed["gate_threshold"]) == (0.25, 0.9) and stt_routing()["capacity"] == 0.5
    changed["capacity"] = 0.1  # a new dict each call
    assert stt_routing()["capacity"] == 0.5
    with pytest.raises(ValueError, match="unknown routing argument.*'mod': prior_factor"):
        mod_routing(prior_factor=0.1)
    with pytest.raises(ValueError, match="'sdt': capacty"):
        sdt_routing(capacty=0.5)


RECOMMENDED_CONFIGS = [(level, f"quickstart/{kind}recommended_{level.replace('.', '_')}_smollm2.yaml")
                       for level in ("0.90", "0.81", "0.72") for kind in ("", "eval_", "generate_")]


@pytest.mark.parametrize("level, path", RECOMMENDED_CONFIGS, ids=[p for _, p in RECOMMENDED_CONFIGS])
def test_recommended_presets_equal_the_shipped_recommended_configs(level, path):
    model = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / path).model, resolve=True)
    routing = {key: value for key, value in model.items() if key in REQUIRED_KEYS["stt"]}
    deployed = "/eval_" in path or "/generate_" in path
    preset = recommended_smollm2_routing(level, **(DEPLOYED_STUDENT if deployed else {}))
    assert model["variant"] == "stt" and preset == routing and tuple(preset) == REQUIRED_KEYS["stt"]
    arch = {key: model[key] for key in qwen2_5.ARCHITECTURE_KEYS}
    with torch.device("meta"):  # builds, so the preset is a complete, valid set for this architecture
        built = qwen2_5.routed_qwen2("stt", **arch, **preset)
    assert sorted(built.routing_layer_indices) == sorted(routing["routed_layers"])
    preset["dropped_layers"].append(0)  # a new dict (and lists) each call
    assert 0 not in recommended_smollm2_routing(level)["dropped_layers"]


def test_an_unknown_recommended_level_is_named():
    with pytest.raises(ValueError, match="unknown recommended level '0.5'; known: 0.90, 0.81, 0.72"):
        recommended_smollm2_routing("0.5")


def test_preset_docstring_example_builds():
    import torch

    with torch.device("meta"):
        model = qwen2_5.stt_qwen2_5_0_5b(**stt_routing())
    assert model.variant == "stt" and len(model.routing_layer_indices) == 11  # every_other_inner of 24 layers
