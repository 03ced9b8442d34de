"""A config's model section is read in one place (torchtune_dtf/models/model_config.py): which builder, variant,
size and LoRA-ness it names (declared by each builder, not parsed from its name), its twins, and the routing the
closed-form FLOPs read (the builder's own validator, not a second parser)."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.modules.peft import LoRALinear

from torchtune_dtf import closed_form as cf
from torchtune_dtf.models import model_config as mc
from torchtune_dtf.models import qwen2_5
from torchtune_dtf.models.qwen2_5 import QWEN2_5_SHAPES
from torchtune_dtf.models.routing_config import validate_routing
from torchtune_dtf.models.routing_presets import stt_routing

REPO = Path(__file__).resolve().parents[1]
PKG = "torchtune_dtf.models.qwen2_5"


def test_every_model_builder_declares_what_it_builds_and_builds_that():
    assert len(mc.MODEL_BUILDERS) == 40
    for (variant, size, lora), builder in mc.MODEL_BUILDERS.items():
        assert builder.identity == mc.BuilderIdentity(variant=variant, size=size, lora=lora)
        assert getattr(qwen2_5, builder.__name__) is builder
        if size != "tiny":
            continue  # built below for the tiny shape only (0.5B–7B would take seconds each, on meta too)
        section = {"_component_": f"{PKG}.{builder.__name__}", "vocab_size": 32, "max_seq_len": 16}
        if variant != "dense":
            section.update(stt_routing(capacity=0.5) if variant == "stt" else {})
        if variant in ("mod", "sdt"):
            continue  # their routing sets are covered by test_builders; the identity is what is tested here
        if lora:
            section.update(lora_attn_modules=["q_proj"], apply_lora_to_mlp=False, lora_rank=2, lora_alpha=4.0,
                           lora_dropout=0.0)
        with torch.device("meta"):
            model = config.instantiate(OmegaConf.create(section))
        assert model.variant == mc.model_variant(section) == variant
        assert mc.is_lora(section) == any(isinstance(m, LoRALinear) for m in model.modules()) == lora
        assert len(model.layers) == QWEN2_5_SHAPES[size]["num_layers"] == mc.architecture(section)["num_layers"]


def test_component_builders_take_variant_and_architecture_from_the_section():
    section = {"_component_": f"{PKG}.routed_qwen2", "variant": "mod", "num_layers": 3, "embed_dim": 8}
    assert mc.model_variant(section) == "mod" and not mc.is_lora(section)
    assert mc.architecture(section) == {"num_layers": 3, "embed_dim": 8}
    assert mc.is_lora({"_component_": f"{PKG}.lora_routed_qwen2", "variant": "mod"})
    with pytest.raises(ValueError, match="takes the variant as an argument"):
        mc.model_variant({"_component_": f"{PKG}.routed_qwen2"})
    with pytest.raises(ValueError, match="takes the architecture as arguments"):
        mc.architecture({"_component_": f"{PKG}.routed_qwen2", "variant": "mod"})


def test_a_component_that_is_not_ours_is_named_in_the_error():
    with pytest.raises(ValueError, match="'torchtune.models.qwen2_5.qwen2_5_0_5b' is not a torchtune_dtf model builder"):
        mc.model_variant({"_component_": "torchtune.models.qwen2_5.qwen2_5_0_5b"})
    with pytest.raises(ValueError, match="cannot be imported"):
        mc.model_variant({"_component_": f"{PKG}.no_such_builder"})
    with pytest.raises(ValueError, match="needs `_component_`"):
        mc.model_variant({"variant": None})


def test_twins_are_found_by_identity_in_the_module_the_config_names():
    lora_tiny = {"_component_": f"{PKG}.lora_stt_qwen2_5_tiny", "lora_rank": 4, "capacity": 0.5, "vocab_size": 32}
    assert mc.dense_model_config(lora_tiny) == {"_component_": f"{PKG}.lora_dense_qwen2_5_tiny", "lora_rank": 4,
                                                "vocab_size": 32}
    assert mc.merged_model_config(lora_tiny) == {"_component_": f"{PKG}.stt_qwen2_5_tiny", "capacity": 0.5,
                                                 "vocab_size": 32}
    inner = f"{PKG}._model_builders.mod_qwen2_5_0_5b"
    assert mc.dense_model_config({"_component_": inner, "capacity": 0.5}) == {
        "_component_": f"{PKG}._model_builders.dense_qwen2_5_0_5b"}
    component = {"_component_": f"{PKG}.routed_qwen2", "variant": "stt", "capacity": 0.5, "num_layers": 4}
    assert mc.dense_model_config(component) == {"_component_": f"{PKG}.routed_qwen2", "variant": "dense",
                                                "num_layers": 4}


def test_closed_form_reads_routing_through_the_builders_validator():
    """A value the builder refuses is refused by the closed form too (it used to read keys on its own), and a
    partial section (only what the cost depends on) still resolves, placements and per-layer capacities alike."""
    toy = dict(_component_=f"{PKG}.routed_qwen2", variant="stt", vocab_size=10, num_layers=4, num_heads=4,
               num_kv_heads=2, embed_dim=8, intermediate_dim=16, tie_word_embeddings=True, causal_router_hidden_dim=6,
               causal_router_input="current", prior_factor=0.5)
    shape = cf.routing_shape_from_model_config({**toy, "routed_layers": [3, 1], "capacity": [0.25, 0.75]}, 4, 8)
    assert shape.routed_layers == (1, 3) and shape.capacity == (0.75, 0.25)  # each layer keeps its listed γ
    assert cf.routing_shape_from_model_config({**toy, "routed_layers": "every_other", "capacity": 0.5}, 4, 8
                                              ).routed_layers == (1, 3)
    with pytest.raises(ValueError, match=r"capacity must be in \(0, 1\]"):
        cf.routing_shape_from_model_config({**toy, "routed_layers": [1], "capacity": 1.5}, 4, 8)
    with pytest.raises(ValueError, match="both routed and dropped"):
        cf.routing_shape_from_model_config({**toy, "routed_layers": [1], "capacity": 0.5, "dropped_layers": [1]}, 4, 8)
    with pytest.raises(ValueError, match="has no routed_layers"):
        cf.routing_shape_from_model_config({**toy, "capacity": 0.5}, 4, 8)
    # the builder itself still requires every key
    with pytest.raises(ValueError, match="missing required routing hyperparameter"):
        validate_routing("stt", 4, routed_layers=[1], capacity=0.5)


def test_the_checkpointer_builds_the_model_on_meta_once(tmp_path, monkeypatch):
    """Setup used to build the configured model on meta three times (recipe identity, checkpointer, routing
    initialisation); the checkpointer now builds it once and initialises routing from copies of its modules."""
    from torchtune_dtf.training import checkpointer as ckpt_module
    from tests.test_checkpointer import checkpointer, model_config, write_hf_dir

    write_hf_dir(tmp_path / "hf")
    builds = []
    real = ckpt_module.RoutedHFCheckpointer._build_meta_model
    monkeypatch.setattr(ckpt_module.RoutedHFCheckpointer, "_build_meta_model",
                        lambda self: builds.append(1) or real(self))
    ckpt = checkpointer(tmp_path / "hf", tmp_path / "out", model_config("stt"))
    state = ckpt.load_checkpoint()["model"]
    assert len(builds) == 1
    routing = {k: v for k, v in state.items() if k in ckpt._routing_shapes}
    assert routing and all(torch.isfinite(v).all() for v in routing.values())
    assert all(p.device.type == "meta" for p in ckpt._meta_model.parameters())  # left untouched
    # the same seed gives the same routing initialisation (copies are initialised in module order)
    again = checkpointer(tmp_path / "hf", tmp_path / "out2", model_config("stt")).load_checkpoint()["model"]
    assert all(torch.equal(routing[k], again[k]) for k in routing)
