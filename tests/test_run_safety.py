"""Issue 13: nothing lost, nothing silently wrong — LoRA saves, shipped configs, checkpoints, resume, guards."""

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.test_recipe import REPO, load_config, run_recipe, train_assets, workdir  # noqa: F401 (fixtures)
from torchtune_dtf.modules import is_routing_key
from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe

TRAINING_CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "dataset" in OmegaConf.load(p))
#: The tiny HF checkpoint the test assets hold (tests/test_recipe.py), as routed_qwen2 arguments.
TINY_SHAPE = dict(vocab_size=151936, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
                  max_seq_len=256, norm_eps=1e-6, rope_base=1e6, tie_word_embeddings=True)


def _local_data(part):
    part = OmegaConf.merge(part, {"source": "json", "data_files": "./corpus.jsonl", "column": "text", "split": "train"})
    part.pop("name", None)
    return part


def tiny_stand_in(path: Path):
    """A shipped training config with its own training settings, on the test assets: the same model family
    at the tiny shape, the tiny checkpoint and tokenizer, the local corpus, CPU."""
    cfg = OmegaConf.load(path)
    model = cfg.model
    if model._component_.endswith(".routed_qwen2"):
        model.update(TINY_SHAPE)
    else:
        model._component_ = re.sub(r"qwen2_5_[0-9a-z_]+$", "qwen2_5_tiny", model._component_)
        model.vocab_size = 151936
    cfg.output_dir = "./outputs"
    cfg.tokenizer = {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "path": "./qwen2_5_tokenizer/vocab.json",
                     "merges_file": "./qwen2_5_tokenizer/merges.txt", "max_seq_len": 48}
    cfg.checkpointer.checkpoint_dir = "./tiny_qwen2_5_hf"
    cfg.checkpointer.checkpoint_files = ["model.safetensors"]
    cfg.dataset = [_local_data(p) for p in cfg.dataset] if OmegaConf.is_list(cfg.dataset) else _local_data(cfg.dataset)
    if cfg.get("dataset_val") is not None:
        cfg.dataset_val = _local_data(cfg.dataset_val)
    cfg.device = "cpu"
    # The corpus has 64 rows: one optimizer step must fit in it.
    cfg.batch_size, cfg.gradient_accumulation_steps = min(cfg.batch_size, 4), 1
    return cfg


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_shipped_training_config_sets_up_and_steps(path, workdir):  # noqa: F811
    """Setup with the config's own settings (activation checkpointing, LoRA, dtype, optimizer…), then one step."""
    cfg = tiny_stand_in(path)
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    batch = next(iter(recipe._dataloader))
    loss, _, _ = recipe._total_loss(batch)
    loss.backward()
    recipe._optimizer.step()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_saves_never_move_the_frozen_base(checkpointing, workdir):  # noqa: F811
    cfg = load_config("lora_stt_train", save_every_n_steps=1, gradient_accumulation_steps=1,
                      enable_activation_checkpointing=checkpointing)
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    adapters = {n.replace("_checkpoint_wrapped_module.", "") for n, p in recipe._model.named_parameters() if p.requires_grad}
    base_before = {k: v.clone() for k, v in recipe._model.state_dict().items() if k not in adapters}
    assert base_before and not any(is_routing_key(k) for k in base_before)
    recipe.train()  # 4 steps, a save after every one
    recipe.cleanup()
    state = recipe._model.state_dict()
    for name, value in base_before.items():
        assert torch.equal(state[name], value), f"{name} moved"

    # The exported weights are the base plus exactly one delta.
    from torchtune_dtf.training.checkpointer import RoutedHFCheckpointer

    exported = RoutedHFCheckpointer(checkpoint_dir=str(workdir / "outputs" / "epoch_0"),
                                    checkpoint_files=["model-00001-of-00001.safetensors"], model_type="QWEN2",
                                    output_dir=str(workdir / "elsewhere"), model=cfg.model,
                                    routing_init_seed=0).load_checkpoint()["model"]
    scale = cfg.model.lora_alpha / cfg.model.lora_rank
    key = "layers.0.attn.q_proj"
    expected = base_before[f"{key}.weight"] + scale * state[f"{key}.lora_b.weight"] @ state[f"{key}.lora_a.weight"]
    torch.testing.assert_close(exported[f"{key}.weight"], expected)
