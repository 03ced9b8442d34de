"""torchtune_dtf.training.checkpointer (RoutedHFCheckpointer): stock HF Qwen2 directories in, HF directories + routing
sidecar out."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torchtune import config, training
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt

from tests.conftest import MAX_SEQ_LEN, MOD_ROUTING, SURPRISE_ROUTING, VOCAB, tiny_architecture
from torchtune_dtf.evaluation.routing_report import load_trained
from torchtune_dtf.models.model_config import merged_model_config
from torchtune_dtf.models.routing_config import with_keys_added_later
from torchtune_dtf.modules import RoutingContext, is_routing_key
from torchtune_dtf.training import ROUTING_WEIGHTS_FNAME, RoutedHFCheckpointer, routed_adapter_state_dict

ROUTING = dict(SURPRISE_ROUTING, ma_window=8)
LORA = dict(
    lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8.0, lora_dropout=0.0
)
VARIANTS = ("dense", "mod", "sdt", "stt")
BETAS = dict(beta_ce=2.0, beta_cu=3.0)


def model_config(variant, lora=False, **overrides):
    """Model component config as a recipe's YAML would give it (after interpolation). Routing
    overrides are ignored for the dense variant, which takes no routing arguments."""
    routing = {} if variant == "dense" else {**ROUTING, **overrides}
    if variant == "mod":
        routing = {k: routing[k] for k in MOD_ROUTING}
    prefix = "lora_" if lora else ""
    component = f"torchtune_dtf.models.qwen2_5.{prefix}{variant}_qwen2_5_tiny"
    cfg = {"_component_": component, "vocab_size": VOCAB, "max_seq_len": MAX_SEQ_LEN, **routing}
    return {**cfg, **LORA} if lora else cfg


def build(model_cfg, device="cpu"):
    with torch.device(device):
        return config.instantiate(OmegaConf.create(model_cfg)).eval()


def write_hf_dir(path, seed=0, max_shard_size=None, dtype=torch.float32, **config_overrides):
    """A real HF Qwen2 directory (config.json + safetensors) with random weights; returns the HF model."""
    hf_config = transformers.Qwen2Config(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "attn_implementation": "eager",
            **config_overrides,
        }
    )
    torch.manual_seed(seed)
    hf_model = transformers.Qwen2ForCausalLM(hf_config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so mis-wiring cannot hide
        for name, param in hf_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.to(dtype).save_pretrained(path, safe_serialization=True, **kwargs)
    return hf_model


def weight_files(path):
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in path.glob("*.safetensors"))


def checkpointer(ckpt_dir, out_dir, model_cfg, seed=0, **kwargs):
    return RoutedHFCheckpointer(
        checkpoint_dir=str(ckpt_dir),
        checkpoint_files=weight_files(ckpt_dir),
        model_type="QWEN2",
        output_dir=str(out_dir),
        model=model_cfg,
        routing_init_seed=seed,
        **kwargs,
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    write_hf_dir(path)
    return path


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))


def every_token_config(variant, lora=False):
    """Student routing that selects every token (σ(r̃) > 0)."""
    return model_config(variant, lora, student_threshold=0.0)


def dense_equivalent_logits(model, tokens):
    with torch.no_grad():
        return model(tokens, routing=RoutingContext(mode="student", apply_gate=False))


# ----------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("sharded", [False, True])
def test_hf_dir_loads_every_base_weight_and_matches_transformers(variant, sharded, tmp_path, tokens):
    hf_path = tmp_path / "hf"
    hf_model = write_hf_dir(hf_path, max_shard_size="500KB" if sharded else None)
    assert (len(weight_files(hf_path)) > 1) == sharded
    cfg = every_token_config(variant)
    state = checkpointer(hf_path, tmp_path / "out", cfg).load_checkpoint()[training.MODEL_KEY]

    hf_state = qwen2_hf_to_tune(
        {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}, num_heads=4, num_kv_heads=2, dim=64
    )
    assert "output.weight" not in state  # tied embeddings
    for key, value in hf_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    assert set(state) - set(hf_state) == {k for k in state if is_routing_key(k)}
    assert (variant == "dense") == (set(state) == set(hf_state))

    model = build(cfg)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        expected = hf_model(tokens).logits
    torch.testing.assert_close(dense_equivalent_logits(model, tokens), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", ["sdt", "stt"])
def test_missing_routing_is_initialised_deterministically(variant, hf_dir, tmp_path):
    cfg = model_config(variant)
    first = checkpointer(hf_dir, tmp_path / "a", cfg, seed=11).load_checkpoint()[training.MODEL_KEY]
    second = checkpointer(hf_dir, tmp_path / "b", cfg, seed=11).load_checkpoint()[training.MODEL_KEY]
    other = checkpointer(hf_dir, tmp_path / "c", cfg, seed=12).load_checkpoint()[training.MODEL_KEY]
    routing = {k: v for k, v in first.items() if is_routing_key(k)}
    assert routing
    for key, value in routing.items():
        torch.testing.assert_close(second[key], value, rtol=0, atol=0)

    o_ce = [F.softplus(v) for k, v in routing.items() if k.endswith("o_ce_raw")]
    m_cu = [F.softplus(v) for k, v in routing.items() if k.endswith("m_cu_raw")]
    assert len(o_ce) == len(m_cu) == 2
    for value in o_ce:
        torch.testing.assert_close(value, torch.full_like(value, 1.025))
    for value in m_cu:
        torch.testing.assert_close(value, torch.full_like(value, 1.1))

    weights = torch.cat([v.flatten() for k, v in routing.items() if k.endswith("proj.weight") or ".hidden.weight" in k])
    assert abs(weights.std().item() - 0.02) < 0.002 and abs(weights.mean().item()) < 0.002
    assert all(torch.all(v == 1) for k, v in routing.items() if k.endswith("norm.scale"))
    assert all(torch.all(v == 0) for k, v in routing.items() if k.endswith("bias"))
    assert not torch.equal(routing[next(k for k in routing if "hidden.weight" in k)],
                           other[next(k for k in routing if "hidden.weight" in k)])


def test_lora_twin_gets_the_same_routing_initialisation(hf_dir, tmp_path):
    plain = checkpointer(hf_dir, tmp_path / "a", model_config("sdt"), seed=4).load_checkpoint()[training.MODEL_KEY]
    twin = checkpointer(hf_dir, tmp_path / "b", model_config("sdt", lora=True), seed=4).load_checkpoint()
    assert set(twin[training.MODEL_KEY]) == set(plain)
    for key, value in plain.items():
        torch.testing.assert_close(twin[training.MODEL_KEY][key], value, rtol=0, atol=0)


def test_initialisation_leaves_global_rng_alone(hf_dir, tmp_path):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    checkpointer(hf_dir, tmp_path / "out", model_config("stt"), seed=0).load_checkpoint()
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_routing_init_follows_checkpoint_dtype(tmp_path):
    hf_path = tmp_path / "hf"
    write_hf_dir(hf_path, dtype=torch.bfloat16)
    state = checkpointer(hf_path, tmp_path / "out", model_config("stt")).load_checkpoint()[training.MODEL_KEY]
    assert {v.dtype for v in state.values()} == {torch.bfloat16}


@pytest.mark.parametrize("variant", VARIANTS)
def test_meta_model_loaded_with_assign_equals_the_cpu_model(variant, hf_dir, tmp_path, tokens):
    cfg = every_token_config(variant)
    state = checkpointer(hf_dir, tmp_path / "out", cfg).load_checkpoint()[training.MODEL_KEY]
    meta_model = build(cfg, device="meta")
    meta_model.load_state_dict(state, strict=True, assign=True)
    with torch.device("cpu"):
        for module in meta_model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()
    assert not any(t.is_meta for t in [*meta_model.parameters(), *meta_model.buffers()])
    reference = build(cfg)
    reference.load_state_dict(state, strict=True)
    torch.testing.assert_close(
        dense_equivalent_logits(meta_model, tokens), dense_equivalent_logits(reference, tokens), rtol=0, atol=0
    )


# ------------------------------------------------------------------------------------------ saving
@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.bfloat16])
def test_saved_config_json_states_the_saved_dtype(saved_dtype, tmp_path):
    """A bf16 release trained in fp32 saves fp32 weights: its config.json must say float32 (the base
    checkpointer copies the release's "bfloat16"), and transformers must then load them as what they are."""
    hf_path = tmp_path / "hf"
    write_hf_dir(hf_path, dtype=torch.bfloat16)
    release = json.loads((hf_path / "config.json").read_text())
    dtype_keys = [k for k in ("torch_dtype", "dtype") if k in release]
    assert dtype_keys and all(release[k] == "bfloat16" for k in dtype_keys)
    cfg = model_config("stt")
    ckpt = checkpointer(hf_path, tmp_path / "out", cfg)
    state = ckpt.load_checkpoint()[training.MODEL_KEY]
    ckpt.save_checkpoint({training.MODEL_KEY: {k: v.to(saved_dtype) for k, v in state.items()}}, epoch=0)

    saved = tmp_path / "out" / "epoch_0"
    name = str(saved_dtype).removeprefix("torch.")
    written = json.loads((saved / "config.json").read_text())
    assert {k: written[k] for k in dtype_keys} == {k: name for k in dtype_keys}
    assert {k: v for k, v in written.items() if k not in dtype_keys} == {k: v for k, v in release.items() if k not in dtype_keys}
    assert {t.dtype for t in load_file(saved / weight_files(saved)[0]).values()} == {saved_dtype}
    assert transformers.AutoConfig.from_pretrained(saved).dtype == saved_dtype
    # The manifest lists config.json at its rewritten size: the folder loads (verify_files) as it is.
    reloaded = checkpointer(saved, tmp_path / "out2", cfg).load_checkpoint()[training.MODEL_KEY]
    assert {v.dtype for v in reloaded.values()} == {saved_dtype}


def trained_like(model):
    """Perturb every parameter so saved weights differ from the loaded ones."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_then_load_round_trips(variant, hf_dir, tmp_path, tokens):
    # Exact-k student selections, compared before and after the round trip (an analysis, not an eval).
    cfg = model_config(variant, student_routing_mode="topk", allow_noncausal_student_topk=True)
    ckpt = checkpointer(hf_dir, tmp_path / "out", cfg)
    model = build(cfg)
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY], strict=True)
    trained_like(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)

    saved = tmp_path / "out" / "epoch_0"
    assert (saved / "config.json").is_file()
    routing_keys = {k for k in original if is_routing_key(k)}
    if routing_keys:
        assert set(load_file(saved / ROUTING_WEIGHTS_FNAME)) == routing_keys
    else:
        assert not (saved / ROUTING_WEIGHTS_FNAME).exists()

    reloaded_state = checkpointer(saved, tmp_path / "out2", cfg, seed=99).load_checkpoint()[training.MODEL_KEY]
    assert set(reloaded_state) == set(original)
    for key, value in original.items():
        torch.testing.assert_close(reloaded_state[key], value, rtol=0, atol=0)
    reloaded = build(cfg)
    reloaded.load_state_dict(reloaded_state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens), model(tokens), rtol=0, atol=0)
        teacher = lambda m: m(tokens, routing=RoutingContext(mode="teacher", **BETAS))  # noqa: E731
        torch.testing.assert_close(teacher(reloaded), teacher(model), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["mod", "stt"])
def test_skip_bias_starts_at_zero_and_round_trips(variant, hf_dir, tmp_path, tokens):
    cfg = model_config(variant, skip_update="bias")
    ckpt = checkpointer(hf_dir, tmp_path / "out", cfg)
    loaded = ckpt.load_checkpoint()[training.MODEL_KEY]
    bias_keys = sorted(k for k in loaded if ".skip_bias." in k)
    assert bias_keys and all(is_routing_key(k) and not loaded[k].any() for k in bias_keys)  # fresh: zero
    model = build(cfg)
    model.load_state_dict(loaded, strict=True)
    trained_like(model)
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)
    saved = tmp_path / "out" / "epoch_0"
    assert set(bias_keys) <= set(load_file(saved / ROUTING_WEIGHTS_FNAME))
    reloaded_state = checkpointer(saved, tmp_path / "out2", cfg, seed=99).load_checkpoint()[training.MODEL_KEY]
    for key in bias_keys:
        assert reloaded_state[key].any()
        torch.testing.assert_close(reloaded_state[key], model.state_dict()[key], rtol=0, atol=0)


def test_saved_dir_is_a_stock_hf_checkpoint(hf_dir, tmp_path, tokens):
    cfg = every_token_config("stt")
    ckpt = checkpointer(hf_dir, tmp_path / "out", cfg)
    model = build(cfg)
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY], strict=True)
    trained_like(model)
    state = model.state_dict()
    ckpt.save_checkpoint({training.MODEL_KEY: state}, epoch=2)
    saved = tmp_path / "out" / "epoch_2"

    stock = training.FullModelHFCheckpointer(
        checkpoint_dir=str(saved),
        checkpoint_files=weight_files(saved),
        model_type="QWEN2",
        output_dir=str(tmp_path / "stock_out"),
    ).load_checkpoint()[training.MODEL_KEY]
    assert set(stock) == {k for k in state if not is_routing_key(k)}
    for key, value in stock.items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)

    hf_model = transformers.Qwen2ForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(dense_equivalent_logits(model, tokens), hf_model(tokens).logits, rtol=0, atol=1e-4)


def test_intermediate_checkpoint_saves_and_resumes_recipe_state(hf_dir, tmp_path):
    cfg = model_config("mod")
    ckpt = checkpointer(hf_dir, tmp_path / "out", cfg)
    model = build(cfg)
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY], strict=True)
    trained_like(model)
    recipe_state = {training.SEED_KEY: 3, training.EPOCHS_KEY: 1, training.OPT_KEY: {"state": {}, "param_groups": []},
                    "run_id": "r1", "global_step": 7}
    state = {training.MODEL_KEY: model.state_dict(), **recipe_state}
    ckpt.begin_run("r1")
    ckpt.save_checkpoint(state, epoch=0, intermediate_checkpoint=True)
    assert training.MODEL_KEY in state  # the caller's dict is left alone
    # The recipe state lives in the checkpoint folder it belongs to, which names its run and step.
    assert (tmp_path / "out" / "epoch_0" / "recipe_state.pt").is_file()
    manifest = json.loads((tmp_path / "out" / "epoch_0" / "checkpoint.json").read_text())
    assert (manifest["run_id"], manifest["global_step"], manifest["routing"]) == ("r1", 7, True)

    resumed = RoutedHFCheckpointer(
        checkpoint_dir=str(hf_dir),
        checkpoint_files=[f"epoch_0/{name}" for name in weight_files(tmp_path / "out" / "epoch_0")],
        model_type="QWEN2",
        output_dir=str(tmp_path / "out"),
        should_load_recipe_state=True,
        model=cfg,
        routing_init_seed=1,
    ).load_checkpoint()
    assert resumed[training.SEED_KEY] == 3 and resumed[training.EPOCHS_KEY] == 1
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed[training.MODEL_KEY][key], value, rtol=0, atol=0)


# -------------------------------------------------------------------------------------------- LoRA
def lora_model_and_checkpointer(hf_dir, out_dir):
    cfg = model_config("stt", lora=True)
    ckpt = checkpointer(hf_dir, out_dir, cfg)
    model = build(cfg)
    state = ckpt.load_checkpoint()
    assert training.ADAPTER_KEY not in state
    missing, unexpected = model.load_state_dict(state[training.MODEL_KEY], strict=False)
    assert not unexpected and missing and all(".lora_" in k for k in missing)
    return cfg, ckpt, trained_like(model)


def adapter_config():
    return {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def test_lora_adapter_only_save_includes_routing_and_resumes(hf_dir, tmp_path):
    cfg, ckpt, model = lora_model_and_checkpointer(hf_dir, tmp_path / "out")
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = routed_adapter_state_dict(model.state_dict())
    ckpt.begin_run("r1")
    ckpt.save_checkpoint(
        {training.ADAPTER_KEY: adapter, training.ADAPTER_CONFIG: adapter_config(), training.SEED_KEY: 0,
         "run_id": "r1", "global_step": 3},
        epoch=0,
        intermediate_checkpoint=True,
        adapter_only=True,
    )
    saved = tmp_path / "out" / "epoch_0"
    assert not list(saved.glob("model*.safetensors"))
    assert {"adapter_model.pt", "adapter_model.safetensors", "adapter_config.json", ROUTING_WEIGHTS_FNAME,
            "recipe_state.pt", "checkpoint.json"} <= {
        p.name for p in saved.iterdir()
    }
    routing_keys = {k for k in trained if is_routing_key(k)}
    assert set(load_file(saved / ROUTING_WEIGHTS_FNAME)) == routing_keys
    assert not any(is_routing_key(k) for k in torch.load(saved / "adapter_model.pt"))

    # Resume as torchtune's LoRA recipes do: base (+ fresh routing) strict=False, then the adapter.
    state = checkpointer(hf_dir, tmp_path / "out", cfg, seed=5, should_load_recipe_state=True).load_checkpoint()
    assert set(state[training.ADAPTER_KEY]) == {k for k in trained if ".lora_" in k} | routing_keys
    resumed = build(cfg)
    resumed.load_state_dict(state[training.MODEL_KEY], strict=False)
    _, unexpected = resumed.load_state_dict(state[training.ADAPTER_KEY], strict=False)
    assert not unexpected
    for key in routing_keys | {k for k in trained if ".lora_" in k}:
        torch.testing.assert_close(resumed.state_dict()[key], trained[key], rtol=0, atol=0)


def test_lora_merged_save_takes_routing_from_model(hf_dir, tmp_path, tokens):
    cfg, ckpt, model = lora_model_and_checkpointer(hf_dir, tmp_path / "out")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = get_adapter_state_dict(state)  # torchtune's: LoRA weights only
    merged = get_merged_lora_ckpt(dict(state), rank=4, alpha=8.0)
    ckpt.save_checkpoint({training.MODEL_KEY: merged, training.ADAPTER_KEY: adapter}, epoch=0)
    saved = tmp_path / "out" / "epoch_0"
    assert set(load_file(saved / ROUTING_WEIGHTS_FNAME)) == {k for k in state if is_routing_key(k)}

    merged_cfg = model_config("stt")
    merged_model = build(merged_cfg)
    reloaded = checkpointer(saved, tmp_path / "out2", merged_cfg).load_checkpoint()[training.MODEL_KEY]
    merged_model.load_state_dict(reloaded, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(merged_model(tokens), model(tokens), rtol=1e-4, atol=1e-4)


def test_lora_run_config_loads_its_merged_checkpoint_into_the_non_lora_twin(hf_dir, tmp_path, tokens):
    """What the study driver, routing_report and routing_plots do with a LoRA run: the config the recipe saved names
    the LoRA builder, the checkpoint holds LoRA merged into the base, and the loaded model is the trained one."""
    cfg, ckpt, model = lora_model_and_checkpointer(hf_dir, tmp_path / "out")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save_checkpoint({training.MODEL_KEY: get_merged_lora_ckpt(dict(state), rank=4, alpha=8.0)}, epoch=0)
    run_cfg = OmegaConf.create({
        "model": cfg,
        "checkpointer": {"_component_": "torchtune_dtf.training.RoutedHFCheckpointer", "checkpoint_dir": "unused",
                         "checkpoint_files": [], "model_type": "QWEN2", "output_dir": "unused",
                         "model": "${model}", "routing_init_seed": 0},
    })
    loaded = load_trained(run_cfg, tmp_path / "out" / "epoch_0")
    assert type(loaded).__name__ == type(model).__name__ and not any(".lora_" in k for k in loaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=1e-4, atol=1e-4)
    assert run_cfg.model._component_.endswith(".lora_stt_qwen2_5_tiny")  # the caller's config is left as it was


def test_merged_model_config_maps_each_lora_builder_to_its_twin():
    assert merged_model_config(model_config("stt", lora=True)) == model_config("stt")
    component = {"_component_": "torchtune_dtf.models.qwen2_5.lora_routed_qwen2", "variant": "mod", "capacity": 0.5,
                 **LORA}
    assert merged_model_config(component) == {"_component_": "torchtune_dtf.models.qwen2_5.routed_qwen2",
                                              "variant": "mod", "capacity": 0.5}
    assert merged_model_config(model_config("mod")) == model_config("mod")
    with pytest.raises(ValueError, match="no non-LoRA twin 'unknown_qwen2_5_tiny'"):
        merged_model_config({"_component_": "torchtune_dtf.models.qwen2_5.lora_unknown_qwen2_5_tiny"})


def test_adapter_only_without_routing_weights_is_refused(hf_dir, tmp_path):
    _, ckpt, model = lora_model_and_checkpointer(hf_dir, tmp_path / "out")
    with pytest.raises(ValueError, match="no routing weights"):
        ckpt.save_checkpoint(
            {training.ADAPTER_KEY: get_adapter_state_dict(model.state_dict())}, epoch=0, adapter_only=True
        )
    assert not (tmp_path / "out" / "epoch_0").exists()


# ----------------------------------------------------------------------------------- mismatches
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(vocab_size=1024), r"tok_embeddings\.weight: checkpoint \(1024, 64\), model \(512, 64\)"),
        (
            dict(hidden_size=128, num_attention_heads=8),
            r"layers\.0\.attn\.q_proj\.weight: checkpoint \(128, 128\), model \(64, 64\)",
        ),
        (dict(num_hidden_layers=5), r"unexpected key\(s\) \[.*'layers\.4\.attn\.k_proj\.bias'"),
        (dict(tie_word_embeddings=False), r"unexpected key\(s\) \['output\.weight'\]"),
    ],
)
def test_mismatched_hf_dir_is_rejected(overrides, expected, tmp_path):
    hf_path = tmp_path / "hf"
    write_hf_dir(hf_path, **overrides)
    with pytest.raises(ValueError, match=expected):
        checkpointer(hf_path, tmp_path / "out", model_config("stt")).load_checkpoint()


def test_missing_base_key_is_rejected(tmp_path):
    hf_path = tmp_path / "hf"
    write_hf_dir(hf_path)
    weights = load_file(hf_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, hf_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['layers\.1\.mlp\.w3\.weight'\]"):
        checkpointer(hf_path, tmp_path / "out", model_config("mod")).load_checkpoint()


def test_sidecar_of_another_routing_config_is_rejected(hf_dir, tmp_path):
    cfg = model_config("stt")
    ckpt = checkpointer(hf_dir, tmp_path / "out", cfg)
    ckpt.save_checkpoint(ckpt.load_checkpoint(), epoch=0)
    saved = tmp_path / "out" / "epoch_0"
    hidden_mismatch = r"layers\.1\.causal_router\.hidden\.weight: checkpoint \(16, 128\), model \(32, 128\)"
    with pytest.raises(ValueError, match=hidden_mismatch):
        checkpointer(saved, tmp_path / "o2", model_config("stt", causal_router_hidden_dim=32)).load_checkpoint()
    with pytest.raises(ValueError, match=r"unexpected key\(s\) \[.*'layers\.1\.transition\.up_proj\.weight'"):
        checkpointer(saved, tmp_path / "o3", model_config("mod")).load_checkpoint()
    with pytest.raises(ValueError, match=r"missing key\(s\) \['layers\.0\.prior_ffn"):
        checkpointer(saved, tmp_path / "o4", model_config("sdt")).load_checkpoint()


def test_save_rejects_unmerged_lora_weights(hf_dir, tmp_path):
    _, ckpt, model = lora_model_and_checkpointer(hf_dir, tmp_path / "out")
    unmerged = r"model state dict: unexpected key\(s\) \['layers\.0\.attn\.q_proj\.lora_a\.weight'"
    with pytest.raises(ValueError, match=unmerged):
        ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)


def test_constructor_rejects_other_model_types_and_incomplete_models(hf_dir, tmp_path):
    with pytest.raises(ValueError, match="QWEN2 only"):
        RoutedHFCheckpointer(
            str(hf_dir), ["model.safetensors"], "LLAMA3", str(tmp_path), model=model_config("mod"), routing_init_seed=0
        )
    with pytest.raises(ValueError, match="_component_"):
        RoutedHFCheckpointer(str(hf_dir), ["model.safetensors"], "QWEN2", str(tmp_path), model={}, routing_init_seed=0)
    with pytest.raises(ValueError, match="missing required routing hyperparameter"):
        checkpointer(hf_dir, tmp_path, {k: v for k, v in model_config("stt").items() if k != "ma_window"})


def test_yaml_checkpointer_with_model_interpolation_loads_strictly(hf_dir, tmp_path):
    """As a recipe builds it: `model: ${model}` in the checkpointer node, should_load_recipe_state passed in."""
    cfg = OmegaConf.create(
        {
            "model": model_config("stt"),
            "checkpointer": {
                "_component_": "torchtune_dtf.training.RoutedHFCheckpointer",
                "checkpoint_dir": str(hf_dir),
                "checkpoint_files": ["model.safetensors"],
                "model_type": "QWEN2",
                "output_dir": str(tmp_path / "out"),
                "model": "${model}",
                "routing_init_seed": 0,
            },
        }
    )
    ckpt = config.instantiate(cfg.checkpointer, should_load_recipe_state=False)
    state = ckpt.load_checkpoint()[training.MODEL_KEY]
    with torch.device("cpu"):
        config.instantiate(cfg.model).load_state_dict(state, strict=True)
    direct = checkpointer(hf_dir, tmp_path / "out2", cfg.model)  # a DictConfig works too
    assert set(direct.load_checkpoint()[training.MODEL_KEY]) == set(state)


def test_a_layerdrop_config_saved_before_skip_update_was_required_still_loads(hf_dir, tmp_path, tokens):
    """Runs trained layer dropping before ``skip_update`` was a required key: the config they saved loads as
    ``skip_update: none`` (what they trained), a config with the key is taken as written, and a variant that has
    no such key gets none."""

    def run_cfg(**routing):
        model = {"_component_": "torchtune_dtf.models.qwen2_5.routed_qwen2", "variant": "layerdrop",
                 **tiny_architecture(), "vocab_size": VOCAB, "dropped_layers": [1], **routing}
        return OmegaConf.create({"model": model, "checkpointer": {
            "_component_": "torchtune_dtf.training.RoutedHFCheckpointer", "checkpoint_dir": "unused",
            "checkpoint_files": [], "model_type": "QWEN2", "output_dir": "unused", "model": "${model}",
            "routing_init_seed": 0}})

    old = load_trained(run_cfg(), hf_dir)
    assert not any(".skip_bias." in k for k in old.state_dict())
    biased = load_trained(run_cfg(skip_update="bias"), hf_dir)
    assert any(".skip_bias." in k for k in biased.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(old(tokens), biased(tokens), rtol=0, atol=0)  # fresh bias: zero
    assert with_keys_added_later({"variant": "dense"}) == {"variant": "dense"}
    assert with_keys_added_later({"variant": "layerdrop", "dropped_layers": [1]})["skip_update"] == "none"
