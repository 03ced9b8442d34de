"""torchtune_dtf.recipes.routed_finetune (with torchtune_dtf.training.schedules, torchtune_dtf.evaluation.routing_report,
torchtune_dtf._quiet): training steps for every variant, loss weights, β schedule, resume, FSDP2, configs."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

from tests.conftest import ROUTED_VARIANTS
from torchtune_dtf.offline.tokenizer_assets import write_qwen2_5_tokenizer_files
from torchtune_dtf.modules import RoutingContext
from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.training.recipe_checks import validate_recipe_config
from torchtune_dtf.training.schedules import BetaSchedule, LossWeights

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny"


def write_tiny_hf_checkpoint(directory: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, torch_dtype="float32",
    )
    Qwen2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)


@pytest.fixture(scope="session")
def train_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_assets")
    write_qwen2_5_tokenizer_files(root / "qwen2_5_tokenizer")
    write_tiny_hf_checkpoint(root / "tiny_qwen2_5_hf")
    shutil.copy(REPO / "tests" / "assets" / "tiny_corpus.jsonl", root / "corpus.jsonl")
    return root


@pytest.fixture
def workdir(train_assets, tmp_path, monkeypatch):
    for name in ("qwen2_5_tokenizer", "tiny_qwen2_5_hf", "corpus.jsonl"):
        os.symlink(train_assets / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def load_config(name: str, **overrides):
    cfg = OmegaConf.load(TINY / f"{name}.yaml")
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def run_recipe(cfg):
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()
    return recipe


def read_log(workdir: Path):
    (log_file,) = (workdir / "outputs" / "logs").glob("*.txt")
    rows = {}
    for line in log_file.read_text().splitlines():
        step, rest = line.split(" | ", 1)
        row = rows.setdefault(int(step.split()[1]), {})
        row.update({k: float(v) for k, v in (kv.split(":", 1) for kv in rest.split())})
    return rows


# ------------------------------------------------------------------------------------ train every variant
@pytest.mark.parametrize("name", [f"{lora}{v}_train" for v in ("dense",) + ROUTED_VARIANTS for lora in ("", "lora_")])
def test_tiny_config_trains_and_checkpoints(name, workdir):
    cfg = load_config(name)
    recipe = run_recipe(cfg)
    assert recipe.global_step == 4
    log = read_log(workdir)
    assert set(log) >= {1, 2, 3, 4}
    assert all(math.isfinite(row["loss/lm"]) for row in log.values() if "loss/lm" in row)
    assert any("val/lm_loss_student" in row for row in log.values())
    epoch_dir = workdir / "outputs" / "epoch_0"
    assert (epoch_dir / "model-00001-of-00001.safetensors").is_file()
    if "dense" not in name:
        assert (epoch_dir / "routing.safetensors").is_file()
        row = log[4]
        assert "beta_ce" in row and "routing/layer_1/selected_fraction" in row
        assert "routing/layer_1/agreement_accuracy" in row


@pytest.mark.parametrize("variant", ("dense",) + ROUTED_VARIANTS)
def test_loss_falls_on_a_repeated_batch(variant, workdir):
    cfg = load_config(f"{variant}_train", max_steps_per_epoch=12, gradient_accumulation_steps=1,
                      save_every_n_steps=1000, **{"validation.every_n_steps": 1000, "lr_scheduler.num_warmup_steps": 0})
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    batch = next(iter(recipe._dataloader))
    losses = []
    for _ in range(12):
        loss, parts, _ = recipe._total_loss(batch)
        loss.backward()
        recipe._optimizer.step()
        recipe._optimizer.zero_grad()
        losses.append(parts["lm"].item())
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_compiled_training_matches_eager(variant, workdir, monkeypatch):
    # compile: True compiles every layer (torchtune's per-layer compile); aot_eager traces forward and
    # backward as inductor would, without C++ codegen. Same data, seed and steps: the same losses and β.
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    logs = {}
    for compiled in (False, True):
        shutil.rmtree(workdir / "outputs", ignore_errors=True)
        run_recipe(load_config(f"{variant}_train", compile=compiled))
        logs[compiled] = read_log(workdir)
    torch._dynamo.reset()
    steps = [step for step, row in logs[False].items() if "loss/lm" in row]
    assert len(steps) >= 2
    for step in steps:
        eager_row, compiled_row = logs[False][step], logs[True][step]
        for key in ("loss/lm", "loss/causal", "grad_norm", "beta_ce"):
            if key in eager_row:
                assert compiled_row[key] == pytest.approx(eager_row[key], rel=1e-4, abs=1e-6), (step, key)
    val = [row["val/lm_loss_student"] for row in logs[True].values() if "val/lm_loss_student" in row]
    assert val and val == pytest.approx([row["val/lm_loss_student"] for row in logs[False].values()
                                         if "val/lm_loss_student" in row], rel=1e-4)


# ------------------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_beta_schedule_ramps_linearly_or_by_cosine_after_warmup(kind, warmup):
    total = 13
    schedule = BetaSchedule(kind, 0.1, 100.0, 0.5, 20.0, warmup, total)
    for step in range(total + 2):
        r = 0.0 if step <= warmup else min(1.0, (step - warmup) / (total - warmup))
        w = r if kind == "linear" else (1 - math.cos(math.pi * r)) / 2
        ce, cu = schedule(step)
        assert math.isclose(ce, 0.1 + w * 99.9) and math.isclose(cu, 0.5 + w * 19.5)
    assert schedule(0) == (0.1, 0.5) and schedule(total) == (100.0, 20.0)
    if kind == "cosine":
        # Cosine is not linear: at mid-way it differs from the straight line except at r = 0.5.
        mid = warmup + (total - warmup) // 4
        assert not math.isclose(schedule(mid)[0], BetaSchedule("linear", 0.1, 100.0, 0.5, 20.0, warmup, total)(mid)[0])


def test_recipe_passes_the_scheduled_beta(workdir):
    cfg = load_config("stt_train", max_steps_per_epoch=4)
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    for step in (0, 1, 3):
        recipe.global_step = step
        ctx = recipe._routing_context("teacher")
        assert (ctx.beta_ce, ctx.beta_cu) == recipe._beta_schedule(step)
    assert recipe._beta_schedule.type == "cosine" and recipe._beta_schedule.total_steps == 4


def test_loss_weights_ramp_linearly_from_zero_over_warmup():
    weights = LossWeights(pred=0.05, causal=0.01, g_reg=0.001, warmup_steps=4)
    assert weights.at(0) == (0.0, 0.0, 0.0)
    assert weights.at(2) == pytest.approx((0.025, 0.005, 0.0005))
    assert weights.at(10) == (0.05, 0.01, 0.001)


@pytest.mark.parametrize(
    "weight, modules",
    [("pred", ("transition.",)), ("causal", ("causal_router.",))],
)
def test_loss_weights_reach_exactly_their_modules(weight, modules, workdir):
    def grads(value):
        cfg = load_config("stt_train", **{f"routing_loss_weights.{weight}": value})
        recipe = RoutedFinetuneRecipe(cfg)
        recipe.setup(cfg)
        batch = next(iter(recipe._dataloader))
        loss, _, _ = recipe._total_loss(batch)
        loss.backward()
        return {n: p.grad.clone() for n, p in recipe._model.named_parameters() if p.grad is not None}

    off, on = grads(0.0), grads(5.0)
    changed = {n for n in on if not torch.allclose(on[n], off.get(n, torch.zeros_like(on[n])))}
    assert changed, f"λ_{weight} changed no gradient"
    assert all(any(m in n for m in modules) for n in changed), sorted(changed)


# ------------------------------------------------------------------------------------------ configs
def test_missing_required_key_fails_before_training():
    cfg = load_config("stt_train")
    del cfg["beta_schedule"]["beta_cu_end"]
    del cfg["learning_rates"]
    with pytest.raises(ValueError, match=r"beta_schedule.beta_cu_end.*|learning_rates") as err:
        validate_recipe_config(cfg)
    assert "beta_schedule.beta_cu_end" in str(err.value) and "learning_rates" in str(err.value)


def test_one_command_line_trains_dense_and_routed_configs_with_calibration_off():
    # scripts/quickstart.sh passes student_calibration.batches=0 to both runs: the dense config (no such section)
    # accepts it; a routed config still needs its whole section, and a dense one asking for calibration is refused.
    dense = load_config("dense_train")
    assert "student_calibration" not in dense
    OmegaConf.update(dense, "student_calibration.batches", 0, force_add=True)
    validate_recipe_config(dense)
    OmegaConf.update(dense, "student_calibration.batches", 2, force_add=True)
    with pytest.raises(ValueError, match="student_calibration.rounds must be a positive integer, got None"):
        validate_recipe_config(dense)
    routed = load_config("stt_train")
    del routed["student_calibration"]["rounds"]
    with pytest.raises(ValueError, match="missing required key.*student_calibration.rounds"):
        validate_recipe_config(routed)


def test_missing_routing_hyperparameter_fails_at_model_build(workdir):
    cfg = load_config("stt_train")
    del cfg["model"]["ma_window"]
    with pytest.raises(ValueError, match="ma_window"):
        RoutedFinetuneRecipe(cfg).setup(cfg)


SHIPPED = sorted(p for p in (REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_shipped_config_parses_and_builds_on_meta(path):
    cfg = OmegaConf.load(path)
    assert OmegaConf.to_container(cfg, resolve=True)  # interpolations resolve
    if "dataset" in cfg:  # a training config
        validate_recipe_config(cfg)
    with torch.device("meta"):
        model = tt_config.instantiate(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    if "0_5b" in cfg.model._component_:
        base = sum(p.numel() for name, p in model.named_parameters()
                   if not any(r in name for r in ("router", "transition", "prior_ffn", "lora_")))
        assert base == 494_032_768
    assert n > 0


# ------------------------------------------------------------------------------------------ FSDP2
def test_two_process_fsdp2_trains_and_saves_a_loadable_checkpoint(workdir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
         str(REPO / "torchtune_dtf" / "recipes" / "routed_finetune.py"), "--config", str(TINY / "stt_train.yaml")],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    saved = workdir / "outputs" / "epoch_0"
    cfg = load_config("stt_train", **{"checkpointer.checkpoint_dir": str(saved),
                                      "checkpointer.checkpoint_files": ["model-00001-of-00001.safetensors"]})
    checkpointer = tt_config.instantiate(cfg.checkpointer)
    model = tt_config.instantiate(cfg.model)
    model.load_state_dict(checkpointer.load_checkpoint()["model"], strict=True)
    logits = model(torch.randint(0, 1000, (1, 12)))
    assert torch.isfinite(logits).all()


def test_routing_report_gives_a_teacher_without_ties_or_position_bias(workdir, capsys):
    from torchtune_dtf.evaluation import routing_report

    overrides = dict(max_steps_per_epoch=2, save_every_n_steps=1000, **{"validation.every_n_steps": 1000})
    for variant in ("dense", "stt"):
        run_recipe(load_config(f"{variant}_train", output_dir=f"./{variant}_run", **overrides))
    report = routing_report.main([
        "--dense", str(TINY / "dense_train.yaml"), "dense_run/epoch_0",
        "--routed", str(TINY / "stt_train.yaml"), "stt_run/epoch_0",
        "--heldout", "corpus.jsonl", "--windows", "4", "--seq-len", "24", "--batch-size", "2",
    ])
    assert report["heldout_tokens"] == 4 * 23
    assert all(math.isfinite(v) for v in report["loss"].values())
    assert report["loss"]["routed_student"] != report["loss"]["dense"]
    assert sorted(report["layers"]) == [1, 3]
    for row in report["layers"].values():
        assert row["teacher/teacher_fraction"] == 0.5  # top-k at γ = 0.5 on 24-token windows
        assert 0 <= row["teacher/agreement_accuracy"] <= 1 and 0 <= row["student/selected_fraction"] <= 1
        # The teacher ranks by the surprise signal at the final β = 100: ties are rare and the selection
        # is not "the first half of the window" (docs/design.md R1).
        assert row["teacher/score_tie_share"] < 0.05
        assert 0.25 < row["teacher/teacher_first_half_share"] < 0.75
    out = capsys.readouterr().out
    assert "routed student" in out and "first_half" in out

    # The side-by-side a user reads: windows spread over the whole file, a paired interval, speed beside the FLOP
    # ratio, greedy continuations with their symptoms, the stock eval's numbers of both.
    for name in ("dense", "stt"):
        Path(f"{name}_eval.json").write_text(json.dumps({"results": {"task": {"acc,none": 0.25 if name == "dense" else 0.5}}}))
    side = routing_report.main([
        "--dense", str(TINY / "dense_train.yaml"), "dense_run/epoch_0",
        "--routed", str(TINY / "stt_train.yaml"), "stt_run/epoch_0",
        "--heldout", "corpus.jsonl", "--windows", "4", "--seq-len", "24", "--batch-size", "2", "--spread",
        "--diagnostic-windows", "2",
        "--bootstrap", "200", "--speed-rounds", "1", "--new-tokens", "5", "--prompt", "The king", "--prompt", "O",
        "--eleuther", "dense_eval.json", "stt_eval.json",
    ])
    assert side["heldout"]["placement"] == "spread" and side["loss"] != report["loss"]  # other windows
    assert side["diagnostic_windows"] == 2 and report["diagnostic_windows"] == 4
    gap = side["student_minus_dense"]
    assert gap["mean"] == pytest.approx(side["loss"]["routed_student"] - side["loss"]["dense"])
    assert gap["interval_95"][0] <= gap["mean"] <= gap["interval_95"][1] and gap["interval_95"][0] < gap["interval_95"][1]
    assert 0.5 < side["flop_ratio"] < 1.0  # two of four layers routed at γ = 0.5
    for key in ("prefill_tokens_per_s", "generate_tokens_per_s"):
        assert set(side["speed"][key]) == {"dense", "routed"} and all(v > 0 for v in side["speed"][key].values())
    for name in ("dense", "routed"):
        rows = side["continuations"][name]
        assert [row["prompt"] for row in rows] == ["The king", "O"]
        assert all(1 <= row["tokens"] <= 5 and 0 <= row["newline_share"] <= 1 and 0 <= row["distinct_2"] <= 1 for row in rows)
    assert side["eleuther"]["routed"] == {"task": {"acc,none": 0.5}}
    out = capsys.readouterr().out
    assert "routed/dense" in out and "Greedy continuations, routed" in out and "distinct-2" in out
    assert "dense   task: acc 0.250" in out and "paired bootstrap" in out


# ------------------------------------------------------------------------- packing, scheduled sampling
def test_packed_dataset_batches_are_block_causal_and_reach_the_model(workdir):
    from torchtune.modules.attention_utils import create_block_causal_mask

    cfg = load_config("stt_train", max_steps_per_epoch=2, **{"dataset.packed": True, "dataset_val.packed": True})
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    batch = next(iter(recipe._dataloader))
    tokens, positions, mask = batch["tokens"], batch["input_pos"], batch["mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 48, 48)
    # Documents restart their positions; the mask is block-causal over exactly those documents.
    for row in range(2):
        # A pack may begin with the rest of a document split across packs (positions run on there).
        starts = sorted({0, *torch.nonzero(positions[row] == 0).squeeze(-1).tolist()})
        assert len(starts) > 1, "a pack with one document tests nothing"
        bounds = starts + [48]
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        expected = create_block_causal_mask([torch.tensor(lens)])[0]
        # Up to the last document start (the pack's padding continues the last positions, so it is
        # not visible in them; its own block is checked by the collate's unit test).
        doc_end = starts[-1]
        assert torch.equal(mask[row, :doc_end, :doc_end], expected[:doc_end, :doc_end])
    # The recipe gives the model the mask and positions: the loss is the masked one.
    ctx = lambda: RoutingContext(mode="student")  # noqa: E731
    with torch.no_grad():
        got = recipe._lm_loss(batch, ctx())
        labels = torch.hstack((batch["labels"][..., 1:], recipe._ignore_labels[:2]))
        masked = recipe._loss_fn(recipe._model(tokens, mask=mask, input_pos=positions, routing=ctx()), labels)
        unmasked = recipe._loss_fn(recipe._model(tokens, routing=ctx()), labels)
    assert got.item() == pytest.approx(masked.item(), abs=1e-6) and abs(got.item() - unmasked.item()) > 1e-3
    recipe.train()
    assert recipe.global_step == 2


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_scheduled_sampling_executes_the_student_mask(share, workdir):
    cfg = load_config("stt_train", **{"scheduled_sampling.share_start": share, "scheduled_sampling.share_end": share,
                                      "log_every_n_steps": 1})
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    batch = next(iter(recipe._dataloader))
    _, _, routing = recipe._total_loss(batch)
    assert routing.execute == ("student" if share == 1.0 else "teacher")
    for record in routing.layers.values():
        executed = record.student_mask if share == 1.0 else record.teacher_mask
        assert torch.equal(record.selected_mask, executed)
    recipe.train()
    assert all(row["scheduled_sampling/executed_student"] == share for row in read_log(workdir).values()
               if "scheduled_sampling/executed_student" in row)


def test_scheduled_sampling_is_a_required_key():
    cfg = load_config("stt_train")
    del cfg["scheduled_sampling"]["ramp_steps"]
    with pytest.raises(ValueError, match="scheduled_sampling.ramp_steps"):
        RoutedFinetuneRecipe(cfg)


def test_validation_refuses_a_noncausal_topk_student_before_training(workdir):
    cfg = load_config("stt_train", **{"model.student_routing_mode": "topk", "model.student_threshold": None,
                                      "student_calibration.batches": 0})
    recipe = RoutedFinetuneRecipe(cfg)
    with pytest.raises(ValueError, match=r"routed layers \[1, 3\].*not causal.*allow_noncausal_student_topk"):
        recipe.setup(cfg)
    assert recipe.global_step == 0


# ------------------------------------------------------------------------------------ own text (README)
def readme_own_text_commands():
    """``{config: overrides}`` of every ``tune run`` command in the README's "Your own text" section."""
    import re
    import shlex

    section = (REPO / "README.md").read_text().split("### Your own text", 1)[1].split("\n### ", 1)[0]
    commands = [shlex.split(block.replace("\\\n", " ")) for block in re.findall(r"```\n(.*?)```", section, re.S)
                if "tune run" in block]
    return {command[command.index("--config") + 1]: command[command.index("--config") + 2:] for command in commands}


def test_readme_own_text_overrides_load_the_users_files_in_the_recipe(workdir):
    from torchtune_dtf.recipes.stock import merge_overrides

    commands = readme_own_text_commands()
    # One command for configs whose dataset is one component, one for the 0.5B configs' mixture (a list).
    assert sorted(commands) == ["configs/quickstart/stt_smollm2.yaml", "configs/stt_qwen0_5b.yaml"]
    shipped = {name: OmegaConf.to_container(OmegaConf.load(REPO / name)) for name in commands}
    assert isinstance(shipped["configs/stt_qwen0_5b.yaml"]["dataset"], list)
    # What the issue ran into fails with a message that names the fix.
    with pytest.raises(ValueError, match=r"`dataset` is a list.*'~dataset' dataset._component_="):
        merge_overrides(shipped["configs/stt_qwen0_5b.yaml"],
                        ["dataset=torchtune.datasets.text_completion_dataset", "dataset.source=json"])

    own = {"my_train.jsonl": [f"Own training document {i} talks about lighthouses and tides." for i in range(12)],
           "my_val.jsonl": [f"Held-out document {i} mentions volcanoes." for i in range(6)]}
    for name, texts in own.items():
        (workdir / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for name, overrides in commands.items():
        merged = merge_overrides(shipped[name], overrides)  # exactly as `tune run` merges them
        validate_recipe_config(merged)
        for key, data_file in (("dataset", "my_train.jsonl"), ("dataset_val", "my_val.jsonl")):
            section = OmegaConf.to_container(merged[key])
            assert section["_component_"] == "torchtune.datasets.text_completion_dataset", (name, key)
            assert (section["source"], section["data_files"], section.get("column", "text")) == ("json", data_file, "text")
            assert "name" not in section and section.get("split", "train") == "train", (name, key, section)
        # The data those sections describe, set up by the recipe with the tiny model and tokenizer.
        cfg = load_config("stt_train", max_steps_per_epoch=2)
        cfg.dataset, cfg.dataset_val = merged.dataset, merged.dataset_val
        recipe = RoutedFinetuneRecipe(cfg)
        recipe.setup(cfg)
        for loader, texts in ((recipe._dataloader, own["my_train.jsonl"]), (recipe._val_dataloader, own["my_val.jsonl"])):
            assert len(loader.dataset) >= 1
            batch = next(iter(loader))
            decoded = recipe._tokenizer.decode([t for t in batch["tokens"].flatten().tolist() if t != recipe._tokenizer.pad_id])
            assert any(t[:20] in decoded for t in texts) and "river" not in decoded, decoded[:200]


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("name, passes_per_batch", [("dense_train", 1), ("stt_train", 2)])
def test_validation_runs_teacher_and_student_only_where_they_differ(name, passes_per_batch, workdir):
    """A model without routed layers computes the same forward in both modes: validation runs it once per batch
    and reports that loss for both; a routed model runs both modes. Either way the numbers are the held-out loss of
    each mode, as computed here batch by batch."""
    cfg = load_config(name, **{"validation.max_batches": 2})
    recipe = RoutedFinetuneRecipe(cfg)
    recipe.setup(cfg)
    calls = []
    handle = recipe._model.register_forward_hook(lambda *args: calls.append(1))
    result = recipe.validate()
    handle.remove()
    batches = [batch for _, batch in zip(range(2), recipe._val_dataloader)]
    assert len(batches) == 2 and len(calls) == passes_per_batch * 2
    recipe._model.eval()
    with torch.no_grad():
        for mode in ("student", "teacher"):
            expected = sum(recipe._lm_loss(b, recipe._routing_context(mode)).item() for b in batches) / 2
            assert result[f"val/lm_loss_{mode}"] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------------ run summary
def test_short_run_logs_its_last_step_and_a_summary(workdir, caplog):
    """log_every_n_steps 10 on a 3-step run: the metric log still holds step 3 and the summary; the summary's
    executed fractions are those of the *saved* (calibrated) student on the first validation batch."""
    from torchtune_dtf.training.calibration import batch_for_calibration

    cfg = load_config("stt_train", max_steps_per_epoch=3, gradient_accumulation_steps=1, log_every_n_steps=10,
                      save_every_n_steps=1000, **{"validation.every_n_steps": 2})
    with caplog.at_level("INFO"):
        recipe = run_recipe(cfg)
    log = read_log(workdir)
    assert sorted(log) == [2, 3]
    assert "loss/lm" in log[3] and "loss/lm" not in log[2]  # step 2 carries validation only
    summary = recipe.summary
    assert (summary["steps"], summary["global_step"], summary["total_steps"]) == (3, 3, 3)
    assert summary["train_lm_loss"] == pytest.approx(log[3]["loss/lm"])
    # The one training log line carries every token of the run.
    assert summary["tokens"] == log[3]["tokens"] == log[3]["summary/tokens"] > 0
    assert summary["val_step"] == 2
    assert summary["val_lm_loss_student"] == pytest.approx(log[2]["val/lm_loss_student"])
    assert summary["val_lm_loss_teacher"] == pytest.approx(log[2]["val/lm_loss_teacher"])
    assert summary["wall_s"] > 0 and summary["tokens_per_second"] == pytest.approx(summary["tokens"] / summary["wall_s"])
    assert summary["output_dir"] == os.path.join("./outputs", "epoch_0")

    # Recompute from the saved checkpoint: a fresh model, a student forward on the first validation batch.
    saved = load_config("stt_train", **{"checkpointer.checkpoint_dir": "./outputs/epoch_0",
                                        "checkpointer.checkpoint_files": ["model-00001-of-00001.safetensors"]})
    model = tt_config.instantiate(saved.model)
    model.load_state_dict(tt_config.instantiate(saved.checkpointer).load_checkpoint()["model"], strict=True)
    loader = recipe._val_dataloader
    batch = batch_for_calibration(loader.collate_fn([loader.dataset[i] for i in range(loader.batch_size)]), -100)
    routing = RoutingContext(mode="student")
    with torch.no_grad():
        model.eval()(batch["tokens"], routing=routing)
    expected = {i: float((r.selected_mask & batch["valid"]).sum() / batch["valid"].sum()) for i, r in routing.layers.items()}
    assert sorted(summary["executed_fraction"]) == [1, 3]
    assert summary["executed_fraction"] == pytest.approx(expected)
    assert {i: log[3][f"summary/layer_{i}/student_executed"] for i in (1, 3)} == pytest.approx(expected)

    text = caplog.text
    assert text.count("Run summary:") == 1
    assert "validation LM loss at step 2 (before student calibration)" in text
    assert "output: ./outputs/epoch_0" in text and "layer 1 " in text and "layer 3 " in text


def test_quiet_filters_drop_exactly_their_messages(caplog):
    """torchtune_dtf/_quiet.py: the named dependency messages go, their neighbours stay."""
    import logging
    import warnings

    import torchtune_dtf  # noqa: F401  (installs the filters)

    with caplog.at_level(logging.WARNING):
        torchao = logging.getLogger("torchao")
        torchao.warning("Skipping import of cpp extensions due to incompatible torch version 2.13.0+cpu for torchao ...")
        torchao.warning("Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1")
        hf_config = logging.getLogger("transformers.configuration_utils")
        hf_config.warning("`torch_dtype` is deprecated! Use `dtype` instead!")
        hf_config.warning("Some other configuration warning")
    assert [r.getMessage() for r in caplog.records] == [
        "Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1",
        "Some other configuration warning",
    ]
    with warnings.catch_warnings(record=True) as caught:
        from torchtune_dtf import _quiet

        _quiet.install()  # pytest's collection ran in a catch_warnings() of its own, which took the filter away
        for module in ("torchdata.stateful_dataloader.stateful_dataloader", "user_code"):
            warnings.warn_explicit("'set_vital' is deprecated, please do not call", UserWarning, "x.py", 1, module=module)
    assert [w.filename for w in caught] == ["x.py"] and len(caught) == 1


def test_per_layer_capacity_reaches_each_listed_layer_through_training_and_calibration(workdir):
    # routed_layers listed out of index order with one γ each (as block-influence placements are written):
    # the teacher must select each layer's own share, and calibration must bring each student to it.
    cfg = load_config("stt_train", **{"model.routed_layers": [3, 1], "model.capacity": [0.25, 0.75],
                                      "capacity_curriculum.ramp_steps": 2})
    run_recipe(cfg)
    log = read_log(workdir)
    last = log[4]
    assert last["routing/layer_1/teacher_fraction"] == pytest.approx(0.75, abs=0.03)
    assert last["routing/layer_3/teacher_fraction"] == pytest.approx(0.25, abs=0.03)
    calibrated = {k: v for row in log.values() for k, v in row.items() if k.startswith("calibration/")}
    assert calibrated["calibration/target_layer_1"] > calibrated["calibration/target_layer_3"] + 0.3
    for layer in (1, 3):
        assert calibrated[f"calibration/after_layer_{layer}"] == pytest.approx(
            calibrated[f"calibration/target_layer_{layer}"], abs=0.1)
