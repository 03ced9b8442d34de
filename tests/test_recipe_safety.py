"""torchtune_dtf.recipes.routed_finetune, torchtune_dtf.training.checkpointer, torchtune_dtf.data.checks, torchtune_dtf.validate:
issue 13, nothing lost, nothing silently wrong — LoRA saves, shipped configs, checkpoints, resume, guards."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from torchtune import config as tt_config

from tests.test_recipe import REPO, load_config, run_recipe, train_assets, workdir  # noqa: F401 (fixtures)
from torchtune_dtf.modules import is_routing_key
from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.training.checkpointer import checkpoint_folders

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
    if model._component_.endswith("routed_qwen2"):  # routed_qwen2 and lora_routed_qwen2
        model.update(TINY_SHAPE)
        if "dropped_layers" in model:  # layer indices of the real shape; the tiny one has 4 layers
            model.dropped_layers = [2]
        if not isinstance(model.get("routed_layers", "every_other"), str):  # a planned list of the real shape
            model.routed_layers = [1]
    else:
        model._component_ = re.sub(r"qwen2_5_[0-9a-z_]+$", "qwen2_5_tiny", model._component_)
        model.vocab_size, model.max_seq_len = 151936, 256  # the tiny checkpoint's
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


# ------------------------------------------------------------------------------- atomic checkpoints
#: Runs the recipe in a subprocess and kills it (SIGKILL) in one phase of its second save (step 4 of 6).
KILL_DRIVER = r'''
import os, shutil, signal, sys
from pathlib import Path
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from torchtune import config as tt_config
import torchtune.training.checkpointing._checkpointer as tt_checkpointer
import torchtune_dtf.training.checkpointer as ckpt
from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.training.checkpointer import checkpoint_folders

phase, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
cfg = OmegaConf.merge(OmegaConf.load(config), OmegaConf.from_dotlist(overrides))
saves = 0
real_save = ckpt.RoutedHFCheckpointer.save_checkpoint
def counting_save(self, *args, **kwargs):
    global saves
    saves += 1
    return real_save(self, *args, **kwargs)
ckpt.RoutedHFCheckpointer.save_checkpoint = counting_save

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def half_written(real, name=None):
    def write(obj, path, *args, **kwargs):
        real(obj, path, *args, **kwargs)
        if saves == 2 and (name is None or Path(path).name == name):
            os.truncate(path, os.path.getsize(path) // 2)
            die()
    return write

if phase == "model_shards":
    tt_checkpointer.save_file = half_written(tt_checkpointer.save_file)
elif phase == "recipe_state":
    torch.save = half_written(torch.save, "recipe_state.pt")
elif phase == "routing_sidecar":
    ckpt.save_file = half_written(ckpt.save_file)
elif phase == "manifest":
    real_fsync = ckpt._fsync
    def fsync(path):
        real_fsync(path)
        if saves == 2 and Path(path).name == ckpt.MANIFEST_FNAME:
            die()
    ckpt._fsync = fsync
elif phase in ("rename", "cleanup"):
    real_replace, real_rmtree = os.replace, shutil.rmtree
    def replace(src, dst):
        real_replace(src, dst)
        if saves == 2 and phase == "rename" and Path(dst).name.startswith(".replaced_"):
            die()  # the previous epoch_0 moved aside, the new one not yet in place
    def rmtree(path, *args, **kwargs):
        if saves == 2 and phase == "cleanup" and Path(path).name.startswith(".replaced_"):
            die()  # the new epoch_0 in place, the previous one not yet deleted
        real_rmtree(path, *args, **kwargs)
    os.replace, ckpt.shutil.rmtree = replace, rmtree
recipe = RoutedFinetuneRecipe(cfg)
recipe.setup(cfg)
recipe.train()
sys.exit(3)  # the kill never came
'''
KILL_OVERRIDES = dict(max_steps_per_epoch=6, save_every_n_steps=2)
_uninterrupted = {}


def uninterrupted_state(workdir):  # noqa: F811
    if not _uninterrupted:
        recipe = run_recipe(load_config("stt_train", output_dir="./uninterrupted", **KILL_OVERRIDES))
        _uninterrupted.update({k: v.clone() for k, v in recipe._model.state_dict().items()})
    return _uninterrupted


def manifest_of(folder: Path):
    return json.loads((folder / "checkpoint.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase, last_complete_step",
    [("model_shards", 2), ("recipe_state", 2), ("routing_sidecar", 2), ("manifest", 2), ("rename", 2), ("cleanup", 4)],
)
def test_kill_9_during_a_save_leaves_the_last_checkpoint_and_resume_is_exact(phase, last_complete_step, workdir):  # noqa: F811
    expected = uninterrupted_state(workdir)
    driver = workdir / "kill_driver.py"
    driver.write_text(KILL_DRIVER)
    overrides = [f"{k}={v}" for k, v in KILL_OVERRIDES.items()]
    proc = subprocess.run(
        [sys.executable, str(driver), phase, str(REPO / "configs" / "tiny" / "stt_train.yaml"), *overrides],
        cwd=workdir, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]

    # The last complete checkpoint is there (epoch_0, or the previous one set aside mid-rename) and loads.
    out = workdir / "outputs"
    (folder,) = checkpoint_folders(out).values()
    assert manifest_of(folder)["global_step"] == last_complete_step
    cfg = load_config("stt_train", **{"checkpointer.checkpoint_dir": str(folder), "checkpointer.output_dir": "./scratch",
                                      "checkpointer.checkpoint_files": ["model-00001-of-00001.safetensors"]})
    model = tt_config.instantiate(cfg.model)
    model.load_state_dict(tt_config.instantiate(cfg.checkpointer).load_checkpoint()["model"], strict=True)

    resumed = RoutedFinetuneRecipe(load_config("stt_train", resume_from_checkpoint=True, **KILL_OVERRIDES))
    cfg = load_config("stt_train", resume_from_checkpoint=True, **KILL_OVERRIDES)
    resumed.setup(cfg)
    assert resumed.global_step == last_complete_step
    resumed.train()
    assert resumed.global_step == 6
    state = resumed._model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # nothing left behind


def test_each_part_of_a_checkpoint_carries_its_step_and_run(workdir):  # noqa: F811
    recipe = run_recipe(load_config("stt_train"))
    folder = workdir / "outputs" / "epoch_0"
    manifest = manifest_of(folder)
    assert manifest["global_step"] == 4 and manifest["run_id"] == recipe._run_id
    with safe_open(folder / "routing.safetensors", framework="pt") as f:
        assert f.metadata()["global_step"] == "4" and f.metadata()["run_id"] == recipe._run_id
    state = torch.load(folder / "recipe_state.pt", weights_only=True)
    assert state["global_step"] == 4 and state["run_id"] == recipe._run_id
    # A recipe state from another save (the parts do not agree) is refused.
    json_text = dict(manifest, global_step=2)
    (folder / "checkpoint.json").write_text(json.dumps(json_text))
    cfg = load_config("stt_train", resume_from_checkpoint="extend", max_steps_per_epoch=6)
    with pytest.raises(ValueError, match=r"routing.safetensors holds global_step 4, its checkpoint 2"):
        RoutedFinetuneRecipe(cfg).setup(cfg)


# ----------------------------------------------------------------------------------- honest resume
def test_resuming_a_finished_run_is_refused_and_extending_is_deliberate(workdir):  # noqa: F811
    finished = run_recipe(load_config("stt_train"))
    final = (workdir / "outputs" / "epoch_0" / "model-00001-of-00001.safetensors").read_bytes()
    for overrides in ({}, {"max_steps_per_epoch": 6}):
        cfg = load_config("stt_train", resume_from_checkpoint=True, **overrides)
        with pytest.raises(ValueError, match="finished run|max_steps_per_epoch: checkpoint 4, config 6") as err:
            RoutedFinetuneRecipe(cfg).setup(cfg)
        assert "resume_from_checkpoint: extend" in str(err.value)
    assert (workdir / "outputs" / "epoch_0" / "model-00001-of-00001.safetensors").read_bytes() == final

    # Extending: raise the length and say so. It continues from step 4 with the same run id.
    extended = run_recipe(load_config("stt_train", resume_from_checkpoint="extend", max_steps_per_epoch=6))
    assert extended.global_step == 6 and extended._run_id == finished._run_id
    assert manifest_of(workdir / "outputs" / "epoch_0")["global_step"] == 6


def test_resume_refuses_the_checkpoint_of_another_run(workdir):  # noqa: F811
    run_recipe(load_config("stt_train", epochs=2))  # an older run: epoch_0 and epoch_1
    newer = RoutedFinetuneRecipe(load_config("stt_train", max_steps_per_epoch=6, save_every_n_steps=2))
    newer.setup(load_config("stt_train", max_steps_per_epoch=6, save_every_n_steps=2))
    real_step = newer._optimizer.step

    def step_then_crash(*args, **kwargs):
        real_step(*args, **kwargs)
        if newer.global_step == 3:
            raise KeyboardInterrupt

    newer._optimizer.step = step_then_crash
    with pytest.raises(KeyboardInterrupt):
        newer.train()
    cfg = load_config("stt_train", resume_from_checkpoint=True, max_steps_per_epoch=6, save_every_n_steps=2)
    with pytest.raises(ValueError, match=r"epoch_1 belongs to run \w+, not to run " + newer._run_id):
        RoutedFinetuneRecipe(cfg).setup(cfg)


CRASH_OVERRIDES = dict(max_steps_per_epoch=6, save_every_n_steps=2)


def _crash_after_step_2() -> None:
    """Train ``stt_train`` (6 steps, a checkpoint every 2) and interrupt it at step 2, after its first checkpoint."""
    crashed = RoutedFinetuneRecipe(load_config("stt_train", **CRASH_OVERRIDES))
    crashed.setup(load_config("stt_train", **CRASH_OVERRIDES))
    crashed._optimizer.step = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt) if crashed.global_step == 2 else None
    with pytest.raises(KeyboardInterrupt):
        crashed.train()


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"learning_rates.backbone": 2.0e-3}, r"learning_rates.backbone: checkpoint 0.001, config 0.002"),
        ({"model.capacity": 0.25}, r"model.capacity: checkpoint 0.5, config 0.25"),
        ({"batch_size": 1}, r"batch_size: checkpoint 2, config 1"),
        ({"optimizer._component_": "torch.optim.SGD", "optimizer.momentum": 0.9},
         r"optimizer._component_: checkpoint 'torch.optim.AdamW', config 'torch.optim.SGD'"),
    ],
)
def test_resume_refuses_changes_it_cannot_honour(override, expected, workdir):  # noqa: F811
    overrides = CRASH_OVERRIDES
    _crash_after_step_2()
    cfg = load_config("stt_train", resume_from_checkpoint=True, **overrides, **override)
    with pytest.raises(ValueError, match=expected) as err:
        RoutedFinetuneRecipe(cfg).setup(cfg)
    assert "Cannot resume" in str(err.value) and "checkpoint_dir=" in str(err.value)


def test_a_checkpoint_older_than_a_config_key_resumes_while_the_key_is_off(workdir):  # noqa: F811
    """``model.dropped_layers`` became a required key after runs had checkpointed: such a checkpoint's fingerprint
    lacks it. With ``[]`` (what those runs computed) it resumes; dropping a layer is a change it cannot honour."""
    overrides = CRASH_OVERRIDES
    _crash_after_step_2()
    (folder,) = checkpoint_folders(workdir / "outputs").values()
    state = torch.load(folder / "recipe_state.pt", weights_only=True)

    def write_as_if_saved(state):  # the manifest records each file's size
        torch.save(state, folder / "recipe_state.pt")
        manifest = manifest_of(folder)
        manifest["files"]["recipe_state.pt"] = (folder / "recipe_state.pt").stat().st_size
        (folder / "checkpoint.json").write_text(json.dumps(manifest))

    assert state["resume_fingerprint"].pop("model.dropped_layers") == []
    write_as_if_saved(state)

    dropping = load_config("stt_train", resume_from_checkpoint=True, **overrides, **{"model.dropped_layers": [2]})
    with pytest.raises(ValueError, match=re.escape("model.dropped_layers: checkpoint [], config [2]")):
        RoutedFinetuneRecipe(dropping).setup(dropping)
    cfg = load_config("stt_train", resume_from_checkpoint=True, **overrides)
    resumed = RoutedFinetuneRecipe(cfg)
    resumed.setup(cfg)
    assert resumed.global_step == 2
    # Any other entry a checkpoint lacks is still a difference.
    state["resume_fingerprint"].pop("model.capacity")
    write_as_if_saved(state)
    with pytest.raises(ValueError, match=re.escape("model.capacity: checkpoint '<absent>', config 0.5")):
        RoutedFinetuneRecipe(cfg).setup(cfg)


# ------------------------------------------------------------------------------ loading invents nothing
def _trained_checkpoint(workdir):  # noqa: F811
    run_recipe(load_config("stt_train", max_steps_per_epoch=2))
    return workdir / "outputs" / "epoch_0"


def _load(folder: Path, files=("model-00001-of-00001.safetensors",)):
    cfg = load_config("stt_train", **{"checkpointer.checkpoint_dir": str(folder), "checkpointer.output_dir": "./scratch",
                                      "checkpointer.checkpoint_files": list(files)})
    return tt_config.instantiate(cfg.checkpointer).load_checkpoint()


def test_a_routed_checkpoint_without_its_sidecar_is_an_error(workdir):  # noqa: F811
    folder = _trained_checkpoint(workdir)
    (folder / "routing.safetensors").unlink()
    with pytest.raises(ValueError, match=r"epoch_0/routing.safetensors is missing: .* was saved from a routed model"):
        _load(folder)
    # Resume too: the trained routers' optimizer moments must not meet fresh routers.
    cfg = load_config("stt_train", resume_from_checkpoint="extend", max_steps_per_epoch=4)
    with pytest.raises(ValueError, match=r"routing.safetensors is missing"):
        RoutedFinetuneRecipe(cfg).setup(cfg)


def test_a_stock_dense_checkpoint_gets_logged_fresh_routing(workdir, caplog):  # noqa: F811
    with caplog.at_level("INFO"):
        state = _load(workdir / "tiny_qwen2_5_hf", ["model.safetensors"])
    assert any(is_routing_key(k) for k in state["model"])
    assert "is a dense checkpoint: routing initialised with seed 0" in caplog.text


# Without its manifest (a folder copied without checkpoint.json) the file formats are checked themselves; the
# recipe state is read only on resume, which requires the manifest, so it has no manifest-less case.
@pytest.mark.parametrize(
    "name, manifest",
    [(name, True) for name in ("routing.safetensors", "model-00001-of-00001.safetensors", "recipe_state.pt")]
    + [(name, False) for name in ("routing.safetensors", "model-00001-of-00001.safetensors")],
)
def test_truncated_files_are_errors_that_name_the_file(name, manifest, workdir):  # noqa: F811
    folder = _trained_checkpoint(workdir)
    if not manifest:
        (folder / "checkpoint.json").unlink()
    path = folder / name
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ValueError, match=re.escape(f"epoch_0/{name}") + ".*truncated"):
        if name == "recipe_state.pt":
            cfg = load_config("stt_train", resume_from_checkpoint="extend", max_steps_per_epoch=4)
            RoutedFinetuneRecipe(cfg).setup(cfg)
        else:
            _load(folder)


# ------------------------------------------------------------------------------ guards before any work
def test_divergence_stops_before_the_step_and_keeps_the_last_checkpoint(workdir):  # noqa: F811
    cfg = load_config("stt_train", max_steps_per_epoch=6, save_every_n_steps=2)
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    real_loss = recipe._loss_fn.forward

    def loss_fn(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if recipe.global_step == 3 else loss  # the loss of step 4 goes NaN

    recipe._loss_fn.forward = loss_fn
    with pytest.raises(FloatingPointError, match=r"diverged at step 4: loss \(lm nan.*checkpoints in output_dir are untouched"):
        recipe.train()
    assert recipe.global_step == 3
    assert all(torch.isfinite(p).all() for p in recipe._model.parameters())
    assert manifest_of(workdir / "outputs" / "epoch_0")["global_step"] == 2


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"learning_rates.backbone": -1.0e-3}, r"learning_rates.backbone must be ≥ 0, got -0.001"),
        ({"save_every_n_steps": 0}, r"save_every_n_steps must be a positive integer, got 0"),
        ({"validation.every_n_steps": 0}, r"validation.every_n_steps must be a positive integer"),
        ({"log_every_n_steps": 0}, r"log_every_n_steps must be a positive integer"),
        ({"max_steps_per_epoch": 0}, r"max_steps_per_epoch must be a positive integer"),
        ({"beta_schedule.beta_ce_end": 0.05}, r"beta_schedule.beta_ce_end \(0.05\) is below beta_ce_start \(0.1\)"),
        ({"resume_from_checkpoint": "yes"}, r"resume_from_checkpoint must be one of"),
    ],
)
def test_bad_values_fail_before_any_work(overrides, expected, workdir):  # noqa: F811
    with pytest.raises(ValueError, match=expected):
        RoutedFinetuneRecipe(load_config("stt_train", **overrides))
    assert not (workdir / "outputs").exists()


def test_a_run_of_zero_steps_is_an_error(workdir):  # noqa: F811
    cfg = load_config("stt_train", batch_size=64)  # 48 training rows
    recipe = RoutedFinetuneRecipe(cfg)
    with pytest.raises(ValueError, match=r"0 optimizer steps per epoch: 48 examples make 0 full batches of batch_size 64"):
        recipe.setup(cfg)
    assert not (workdir / "outputs" / "epoch_0").exists()


@pytest.mark.parametrize("key, value", [("num_attention_heads", 8), ("num_key_value_heads", 4), ("intermediate_size", 256)])
def test_config_json_that_disagrees_with_the_model_is_an_error(key, value, workdir):  # noqa: F811
    edited = workdir / "edited_hf"
    edited.mkdir()
    for f in (workdir / "tiny_qwen2_5_hf").iterdir():
        os.symlink(f, edited / f.name)
    hf = json.loads((workdir / "tiny_qwen2_5_hf" / "config.json").read_text())
    (edited / "config.json").unlink()
    (edited / "config.json").write_text(json.dumps(dict(hf, **{key: value})))
    with pytest.raises(ValueError, match=rf"edited_hf/config.json: {key} is {value}, the configured model has"):
        _load(edited, ["model.safetensors"])


# ------------------------------------------------------------------------------------- bad data rows
@pytest.mark.parametrize(
    "bad_line, expected",
    [
        (b'{"title": "no text here"}\n', r"line 5: no 'text' field"),
        (b'{"text": null}\n', r"line 5: 'text' is NoneType, not text"),
        (b'{"text": "caf\xe9 in latin-1"}\n', r"line 5: not UTF-8"),
        (b'{"text": \n', r"line 5: not valid JSON"),
    ],
)
def test_bad_rows_fail_at_setup_naming_file_and_line(bad_line, expected, workdir):  # noqa: F811
    lines = (workdir / "corpus.jsonl").read_bytes().splitlines(keepends=True)
    (workdir / "bad.jsonl").write_bytes(b"".join(lines[:4]) + bad_line + b"".join(lines[4:]))
    cfg = load_config("stt_train", **{"dataset.data_files": "./bad.jsonl"})
    recipe = RoutedFinetuneRecipe(cfg)
    with pytest.raises(ValueError, match=r"bad.jsonl, " + expected):
        recipe.setup(cfg)
    assert recipe.global_step == 0


def test_an_empty_data_file_is_named(workdir):  # noqa: F811
    (workdir / "empty.jsonl").write_bytes(b"")
    cfg = load_config("stt_train", **{"dataset_val.data_files": "./empty.jsonl"})
    with pytest.raises(ValueError, match=r"empty.jsonl: empty file"):
        RoutedFinetuneRecipe(cfg).setup(cfg)


# ------------------------------------------------------------------------------------ config check CLI
def _validate(workdir, config, *overrides):  # noqa: F811
    return subprocess.run(
        [sys.executable, "-m", "torchtune_dtf.validate", str(config), *overrides],
        cwd=workdir, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_validate_cli_checks_what_the_recipe_checks_without_training(workdir):  # noqa: F811
    tiny = REPO / "configs" / "tiny"
    ok = _validate(workdir, tiny / "lora_stt_train.yaml", "enable_activation_checkpointing=True")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "OK" in ok.stdout and "4 optimizer steps" in ok.stdout and "starts a new run" in ok.stdout
    assert not (workdir / "outputs" / "run.json").exists() and not list((workdir / "outputs").glob("epoch_*"))

    bad = _validate(workdir, tiny / "stt_train.yaml", "learning_rates.backbone=-1e-3", "log_every_n_steps=0")
    assert bad.returncode == 1
    assert "learning_rates.backbone must be ≥ 0" in bad.stderr and "log_every_n_steps must be" in bad.stderr

    cfg = OmegaConf.load(tiny / "stt_train.yaml")
    del cfg.beta_schedule.beta_cu_end
    OmegaConf.save(cfg, workdir / "missing.yaml")
    missing = _validate(workdir, workdir / "missing.yaml")
    assert missing.returncode == 1 and "beta_schedule.beta_cu_end" in missing.stderr

    # With resume: the resume checks too (here, a finished run).
    run_recipe(load_config("stt_train"))
    finished = _validate(workdir, tiny / "stt_train.yaml", "resume_from_checkpoint=True")
    assert finished.returncode == 1 and "finished run" in finished.stderr


@pytest.mark.parametrize(
    "config_name, extra, crash_after_step",
    [
        ("stt_train", {"save_every_n_steps": 3}, 4),  # after the step-3 checkpoint, before step 5
        # LoRA resumes from the adapter and routing of its own checkpoint onto an untouched base
        ("lora_stt_train", {"save_every_n_steps": 2, "gradient_accumulation_steps": 1}, 3),
    ],
)
def test_kill_and_resume_matches_uninterrupted(workdir, config_name, extra, crash_after_step):  # noqa: F811
    """A run killed between checkpoints and resumed ends with exactly the weights of an uninterrupted run."""
    overrides = dict(max_steps_per_epoch=6, **extra)
    full = run_recipe(load_config(config_name, output_dir="./uninterrupted", **overrides))
    expected = {k: v.clone() for k, v in full._model.state_dict().items()}

    crashed = RoutedFinetuneRecipe(load_config(config_name, **overrides))
    crashed.setup(load_config(config_name, **overrides))
    real_step = crashed._optimizer.step

    def step_then_crash(*args, **kwargs):
        real_step(*args, **kwargs)
        if crashed.global_step == crash_after_step:
            raise KeyboardInterrupt

    crashed._optimizer.step = step_then_crash
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    resumed = run_recipe(load_config(config_name, resume_from_checkpoint=True, **overrides))
    assert resumed.global_step == 6
    state = resumed._model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


def test_a_hub_dataset_with_null_text_is_named():
    from datasets import Dataset

    from torchtune_dtf.data.checks import check_text_column

    class Loaded:  # what torchtune's TextCompletionDataset holds
        _data = Dataset.from_dict({"text": ["a", None, "c"]})

    with pytest.raises(ValueError, match=r"wikitext \(train\): 1 row\(s\) without text in column 'text', the first is row 1"):
        check_text_column(Loaded(), "text", "dataset wikitext (train)")
    with pytest.raises(ValueError, match=r"no column 'article'"):
        check_text_column(Loaded(), "article", "dataset cnn")
