"""torchtune_dtf.training.skip_bias_init and the recipe's ``skip_bias_init`` section: each skip bias starts at the mean
true update of the real tokens its layer skips (a routed layer: its teacher's selection), checked against the
layers' own blocks run by hand on the hidden states of the same forward."""

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune.modules import TransformerSelfAttentionLayer

from tests.conftest import VOCAB, build_tiny
from tests.test_recipe import REPO, TINY, load_config, train_assets, workdir  # noqa: F401  (fixtures)
from torchtune_dtf.modules import RoutingContext
from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.training.recipe_checks import validate_recipe_config
from torchtune_dtf.training.skip_bias_init import init_skip_biases, mean_skipped_updates

ROUTED, DROPPED = 1, 2


def _hybrid(variant="stt"):
    return build_tiny(variant, routed_layers=[ROUTED], dropped_layers=[DROPPED], skip_update="bias",
                      skipped_tokens_write_kv=True, always_run_first_token=True)


def _batch():
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(11))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[2, 17:] = False  # a padded row: its tail is in no mean
    return {"tokens": tokens, "valid": valid}


def _teacher():
    return RoutingContext(mode="teacher", beta_ce=torch.tensor(100.0), beta_cu=torch.tensor(100.0))


def _reference(model, batch):
    """Per layer, the true updates ``[b, s, d]`` of its block on its input in a teacher forward, and that forward's
    routed-layer selection."""
    model.output_hidden_states = [ROUTED, DROPPED]
    ctx = _teacher()
    with torch.no_grad():
        h_routed, h_dropped, _ = model(batch["tokens"], routing=ctx)
        updates = {idx: TransformerSelfAttentionLayer.forward(model.layers[idx], h) - h
                   for idx, h in ((ROUTED, h_routed), (DROPPED, h_dropped))}
    model.output_hidden_states = []
    return updates, ctx.layers[ROUTED].selected_mask


@pytest.mark.parametrize("variant", ["stt", "mod"])
def test_mean_is_over_the_real_tokens_each_layer_skips(variant):
    model, batch = _hybrid(variant), _batch()
    means = mean_skipped_updates(model, [batch], _teacher)
    updates, selected = _reference(model, batch)
    valid = batch["valid"]

    skipped = valid & ~selected
    torch.testing.assert_close(means[ROUTED], updates[ROUTED][skipped].mean(0), rtol=1e-5, atol=1e-6)
    not_first = valid.clone()
    not_first[:, 0] = False
    torch.testing.assert_close(means[DROPPED], updates[DROPPED][not_first].mean(0), rtol=1e-5, atol=1e-6)

    # The selection carries signal: the skipped tokens' mean is not the mean over every token, nor is padding in it.
    assert 0.0 < skipped.float().sum() / valid.sum() < 1.0
    assert (means[ROUTED] - updates[ROUTED][valid].mean(0)).norm() > 0.05 * means[ROUTED].norm()
    padded = torch.ones_like(valid)
    padded[:, 0] = False
    assert (means[DROPPED] - updates[DROPPED][padded].mean(0)).abs().max() > 1e-4


def test_batches_are_pooled_by_token_not_by_batch():
    model, batch = _hybrid(), _batch()
    first = {"tokens": batch["tokens"][:1], "valid": batch["valid"][:1]}
    rest = {"tokens": batch["tokens"][1:], "valid": batch["valid"][1:]}
    torch.testing.assert_close(mean_skipped_updates(model, [first, rest], _teacher)[DROPPED],
                               mean_skipped_updates(model, [batch], _teacher)[DROPPED], rtol=1e-5, atol=1e-6)


def test_init_sets_each_bias_and_leaves_no_hooks():
    model, batch = _hybrid(), _batch()
    means = mean_skipped_updates(model, [batch], _teacher)
    init_skip_biases(model, [batch], _teacher)
    for idx in (ROUTED, DROPPED):
        torch.testing.assert_close(model.layers[idx].skip_bias.update.detach(), means[idx])
        assert not model.layers[idx]._forward_hooks and not model.layers[idx]._forward_pre_hooks
    # The dropped layer now adds its mean update to every token.
    x = torch.randn(2, 5, model.layers[DROPPED].skip_bias.update.shape[0])
    torch.testing.assert_close(model.layers[DROPPED](x), x + means[DROPPED])


def test_a_model_without_skip_bias_is_refused():
    model = build_tiny("stt", routed_layers=[ROUTED], dropped_layers=[DROPPED], skip_update="none")
    with pytest.raises(ValueError, match="no skip bias to initialise"):
        init_skip_biases(model, [_batch()], _teacher)


@pytest.mark.parametrize("section, message", [
    ({"batches": -1}, r"skip_bias_init.batches must be an integer ≥ 0"),
    ({"rounds": 2}, r"skip_bias_init.batches must be an integer ≥ 0"),
    ({"batches": 2}, r"model.skip_update is 'none'"),
])
def test_bad_skip_bias_init_sections_are_refused_naming_the_key(section, message):
    cfg = load_config("stt_train")
    cfg.skip_bias_init = OmegaConf.create(section)
    with pytest.raises(ValueError, match=message):
        validate_recipe_config(cfg)


def _set_up(cfg):
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    return recipe


def test_recipe_starts_each_skip_bias_at_the_mean_update(workdir):  # noqa: F811
    overrides = {"model.routed_layers": [ROUTED], "model.dropped_layers": [DROPPED], "model.skip_update": "bias",
                 "skip_bias_init": {"batches": 2}}
    initialised = _set_up(load_config("stt_train", **overrides))
    plain = _set_up(load_config("stt_train", **{**overrides, "skip_bias_init": {"batches": 0}}))
    batches = plain._first_training_batches(2)
    assert len(batches) == 2
    means = mean_skipped_updates(plain._model, batches, lambda: plain._routing_context("teacher"))
    for idx in (ROUTED, DROPPED):
        assert plain._model.layers[idx].skip_bias.update.abs().max() == 0  # off: zero, as before the section
        torch.testing.assert_close(initialised._model.layers[idx].skip_bias.update.detach(), means[idx])
        assert means[idx].norm() > 0


def test_two_process_fsdp2_run_starts_from_the_same_means(workdir):  # noqa: F811
    """Sharded: the block runs on unsharded weights in the hook, the sums are all-reduced, and each rank's shard
    of a bias is set. Router LR 0 keeps the biases where the initialisation put them, so the saved ones must be
    the single-device run's."""
    overrides = {"model.routed_layers": [ROUTED], "model.dropped_layers": [DROPPED], "model.skip_update": "bias",
                 "skip_bias_init": {"batches": 2}, "learning_rates.routers": 0.0, "max_steps_per_epoch": 1}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    dotlist = [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in overrides.items()]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29519",
         str(REPO / "torchtune_dtf" / "recipes" / "routed_finetune.py"), "--config", str(TINY / "stt_train.yaml"),
         *dotlist],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    expected = _set_up(load_config("stt_train", **overrides))._model
    cfg = load_config("stt_train", **{**overrides, "checkpointer.checkpoint_dir": str(workdir / "outputs" / "epoch_0"),
                                      "checkpointer.checkpoint_files": ["model-00001-of-00001.safetensors"]})
    saved = tt_config.instantiate(cfg.checkpointer).load_checkpoint()["model"]
    for idx in (ROUTED, DROPPED):
        key = f"layers.{idx}.skip_bias.update"
        assert expected.layers[idx].skip_bias.update.norm() > 0
        torch.testing.assert_close(saved[key], expected.layers[idx].skip_bias.update.detach(), rtol=1e-4, atol=1e-5)
