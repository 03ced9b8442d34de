"""experiments/study.py and the experiments package (with torchtune_dtf.evaluation.metric_logs): the experiment
driver end to end on a micro study of the tiny model, offline.

Fast path: dense + STT, one seed of two, 2 steps each, no eleuther step: the run JSONs' fields, a rerun that
skips finished runs (no retraining), and the aggregate README (tables, paired differences, partial study, plots).
Slow paths: the stock eleuther_eval step; a study killed mid-training and resumed from its checkpoint.
"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from experiments import StudyError
from experiments.eleuther import eleuther_config, parse_eleuther_table
from experiments.evaluation import curves_from_log
from experiments.frontier import claims, targets
from experiments.pages import aggregate, comparison_section
from experiments.results import layer_mean_curve, load_results, paired_curve_difference
from experiments.spec import load_study
from experiments.stats import paired_difference, seed_window_bootstrap
from experiments.subprocesses import write_json
from experiments.training import DONE_MARKER, planned_config, schedule_every, stale_keys, training_state
from tests.test_recipe import train_assets  # noqa: F401,E402  (session fixture)
from torchtune_dtf.evaluation.metric_logs import parse_disk_logs

REPO = Path(__file__).resolve().parents[1]
STUDY_PY = REPO / "experiments" / "study.py"
TINY = REPO / "configs" / "tiny"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def assets(train_assets):  # noqa: F811  (the recipe tests' tokenizer, tiny checkpoint and corpus)
    tasks = train_assets / "lm_eval_tasks"
    if not tasks.exists():
        shutil.copytree(REPO / "tests" / "assets" / "lm_eval_tasks", tasks)
    return train_assets


@pytest.fixture
def workdir(assets, tmp_path):
    for name in ("qwen2_5_tokenizer", "tiny_qwen2_5_hf", "corpus.jsonl", "lm_eval_tasks"):
        os.symlink(assets / name, tmp_path / name)
    return tmp_path


def write_study(workdir: Path, *, seeds, runs, budget=None, eleuther=None, points=2, **extra) -> Path:
    study = {
        "name": "micro",
        "out_dir": "out",
        "work_dir": "work",
        "seeds": seeds,
        "budget": budget or {"max_steps_per_epoch": 2},
        "validation_points": points,
        "heldout": {"file": "corpus.jsonl", "windows": 4, "seq_len": 32, "batch_size": 2},
        "eleuther": eleuther,
        "baselines": ["dense"] if any(r["name"] == "dense" for r in runs) else [],
        "runs": runs,
        **extra,
    }
    path = workdir / "study.yaml"
    path.write_text(json.dumps(study, indent=1))  # JSON is YAML
    return path


def driver(workdir: Path, *args, **popen) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run([sys.executable, str(STUDY_PY), *args], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=900, **popen)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


RUNS = [
    {"name": "dense", "config": str(TINY / "dense_train.yaml")},
    {"name": "stt", "config": str(TINY / "stt_train.yaml"), "overrides": {"model.gate": "straight_through"}},
    {"name": "mod", "config": str(TINY / "mod_train.yaml")},  # in the study, never run here: "missing"
]


def check_run_json(result, name, seed, variant):
    assert result["schema"] == "study_run/1" and (result["name"], result["seed"], result["variant"]) == (name, seed, variant)
    assert result["config"]["seed"] == seed and result["config"]["checkpointer"]["routing_init_seed"] == seed
    assert result["config"]["max_steps_per_epoch"] == 2 and result["steps"] == 2 and result["planned_steps"] == 2
    assert result["train_tokens"] > 0 and result["train_attempts"][0]["mode"] == "fresh"
    wall = result["wall_time_s"]
    assert wall["train"] > 0 and wall["heldout_eval"] > 0 and wall["eval"] >= wall["heldout_eval"]
    curves = result["curves"]
    assert curves["steps"] == [1, 2]
    for key in ("loss/lm", "val/lm_loss_student", "val/lm_loss_teacher", "tokens", "lr/backbone"):
        assert all(finite(v) for v in curves["series"][key]), key
    assert sum(curves["series"]["tokens"]) == result["train_tokens"]
    heldout = result["heldout"]
    assert heldout["tokens"] == 4 * 31 and finite(heldout["student_loss"]) and heldout["student_loss"] > 0
    compute = result["compute"]
    for key in ("forward_flops_per_token", "dense_forward_flops_per_token", "forward_flops_ratio", "kv_bytes_per_token",
                "dense_kv_bytes_per_token", "kv_bytes_ratio"):
        assert finite(compute[key]) and compute[key] > 0, key
    assert compute["seq_len"] == 32 and compute["distillation_teacher_flops_per_token"] == 0
    assert result["eleuther"] is None and result["wall_time_s"]["eleuther"] is None


TEST_SET = {"file": "test.jsonl", "windows": 3, "seq_len": 32, "spread": True, "batch_size": 2}


def write_test_file(workdir: Path) -> None:
    """Text the study's held-out file does not start with: the corpus's last documents, in reverse order."""
    lines = (workdir / "corpus.jsonl").read_text().splitlines()
    (workdir / "test.jsonl").write_text("\n".join(reversed(lines[-40:])) + "\n")


def direct_window_losses(saved_config: Path, checkpoint_dir: Path, test: dict, routed: bool):
    """Each test window's mean next-token cross-entropy, computed here from the logits of the loaded checkpoint
    (from the study's folder: the saved config's paths are relative to where it trained)."""
    with contextlib.chdir(saved_config.parents[3]):
        return _direct_window_losses(saved_config, checkpoint_dir, test, routed)


def _direct_window_losses(saved_config: Path, checkpoint_dir: Path, test: dict, routed: bool):
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torchtune import config

    from torchtune_dtf.evaluation.routing_report import heldout_windows, load_trained
    from torchtune_dtf.modules import RoutingContext

    cfg = OmegaConf.load(saved_config)
    windows = heldout_windows(config.instantiate(cfg.tokenizer), Path(test["file"]), test["seq_len"], test["windows"],
                              spread=True)
    model = load_trained(cfg, checkpoint_dir)
    with torch.no_grad():
        logits = model(windows, routing=RoutingContext(mode="student")) if routed else model(windows)
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), windows[:, 1:].flatten(), reduction="none")
    return losses.view(windows.shape[0], -1).mean(-1).tolist()


def test_micro_study_writes_runs_skips_finished_ones_and_flags_stale_ones(workdir):
    write_test_file(workdir)
    study = write_study(workdir, seeds=[0, 1], runs=RUNS, test=TEST_SET)
    proc = driver(workdir, "run", str(study), "--only", "dense", "stt", "--seeds", "0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = workdir / "out"
    dense = json.loads((out / "runs" / "dense__seed0.json").read_text())
    stt = json.loads((out / "runs" / "stt__seed0.json").read_text())
    check_run_json(dense, "dense", 0, "dense")
    check_run_json(stt, "stt", 0, "stt")
    # The test windows: scored once at the end, each window's loss kept; they are the checkpoint's own losses.
    for result, routed in ((dense, False), (stt, True)):
        test = result["test"]
        assert (test["windows"], test["seq_len"], test["placement"], test["tokens"]) == (3, 32, "spread", 3 * 31)
        assert test["file"] == str(workdir / "test.jsonl") and result["wall_time_s"]["test_eval"] > 0
        run_dir = workdir / "work" / "runs" / f"{result['name']}__seed{result['seed']}"
        direct = direct_window_losses(run_dir / "torchtune_config.yaml", run_dir / "epoch_0",
                                      {**TEST_SET, "file": workdir / "test.jsonl"}, routed)
        assert test["window_losses"] == pytest.approx(direct, abs=1e-5)
        assert test["student_loss"] == pytest.approx(sum(direct) / 3, abs=1e-5)
        assert test["student_loss"] != pytest.approx(result["heldout"]["student_loss"], abs=1e-3)  # other text

    # dense: every layer runs; no teacher, no routed layer
    assert dense["compute"]["forward_flops_ratio"] == 1 and dense["compute"]["kv_bytes_ratio"] == 1
    assert dense["heldout"]["teacher_loss"] is None and dense["executed_fraction"] == {}
    # STT: the student runs part of the tokens of layers 1 and 3; FLOPs and KV below dense
    assert set(stt["executed_fraction"]) == {"1", "3"}
    assert all(0 < f <= 1 for f in stt["executed_fraction"].values())
    assert stt["compute"]["executed_fraction_used"] == stt["executed_fraction"]
    assert stt["compute"]["forward_flops_ratio"] < 1 and stt["compute"]["kv_bytes_ratio"] < 1
    assert stt["compute"]["dense_forward_flops_per_token"] == dense["compute"]["forward_flops_per_token"]
    assert finite(stt["heldout"]["teacher_loss"]) and stt["heldout"]["teacher_beta"] == {"ce": 100.0, "cu": 100.0}
    assert stt["config"]["model"]["gate"] == "straight_through"  # the run's override reached the recipe
    assert 0 <= stt["layers"]["1"]["teacher/agreement_accuracy"] <= 1
    assert set(stt["routing_stats"]) == {"layer_1", "layer_3"}
    assert set(stt["routing_stats"]["layer_1"]["selected_fraction"]) == {"mean", "first", "last"}
    assert any(k.startswith("routing/layer_1/") for k in stt["curves"]["series"])

    # Rerun: finished runs are skipped, nothing is retrained or rewritten.
    files = [out / "runs" / "dense__seed0.json", out / "runs" / "stt__seed0.json",
             workdir / "work" / "runs" / "stt__seed0" / "epoch_0" / "model-00001-of-00001.safetensors"]
    mtimes = [p.stat().st_mtime_ns for p in files]
    logs = sorted((workdir / "work" / "logs").rglob("train_*.log"))
    proc = driver(workdir, "run", str(study), "--only", "dense", "stt", "--seeds", "0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("done, skipped") == 2 and "training" not in proc.stdout
    assert [p.stat().st_mtime_ns for p in files] == mtimes
    assert sorted((workdir / "work" / "logs").rglob("train_*.log")) == logs

    # The aggregate of this partial study: seed 1 missing everywhere, `mod` absent.
    readme = (out / "README.md").read_text()
    assert "PARTIAL" in readme
    assert "`mod`: no seed finished" in readme and "`stt`: seeds [1] missing" in readme
    runs_table = readme.split("## Runs")[1].split("## Paired")[0]
    rows = {line.split("|")[1].strip(): line for line in runs_table.splitlines() if line.startswith("| `")}
    assert {"`dense`", "`stt`", "`mod`"} <= set(rows)
    assert "1/2 (partial)" in rows["`stt`"] and "none (missing)" in rows["`mod`"]
    assert "## Paired differences against `dense`" in readme
    for plot in ("frontier.png", "curves.png", "validation.png", "executed_fraction.png", "claims.png"):
        data = (out / plot).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, plot
        assert f"]({plot})" in readme
    # The claims table has the STT run with its predictor loss, the held-out share of the update its TPN leaves
    # unexplained (D_ch/D_st of its layers' reports), its CE/CU shares over training and its agreement.
    claims = readme.split("## The papers' claims")[1].split("## Run files")[0]
    (stt_row,) = [line for line in claims.splitlines() if line.startswith("| stt |")]
    cells = [c.strip() for c in stt_row.strip("|").split("|")]
    assert cells[1] == "stt" and "→" in cells[3] and "→" in cells[5] and "→" in cells[6], stt_row
    shares = [row["teacher/d_ch"] / row["teacher/d_st"] for row in stt["layers"].values()]
    assert len(shares) == 2 and float(cells[4]) == pytest.approx(sum(shares) / 2, abs=5e-4)
    assert 0 <= float(cells[7]) <= 1

    # A second seed (here: copies with shifted losses) gives paired differences with a t-interval.
    for name, shift in (("dense", 0.0), ("stt", 0.3)):
        result = json.loads((out / "runs" / f"{name}__seed0.json").read_text())
        result["seed"] = result["config"]["seed"] = 1
        result["heldout"]["student_loss"] += shift
        result["test"]["window_losses"] = [v + shift for v in result["test"]["window_losses"]]
        result["test"]["student_loss"] += shift
        (out / "runs" / f"{name}__seed1.json").write_text(json.dumps(result))
    proc = driver(workdir, "aggregate", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    readme = (out / "README.md").read_text()
    paired = [line for line in readme.split("## Paired differences against `dense`")[1].split("## Test set")[0].splitlines()
              if line.startswith("| `stt`")]
    assert len(paired) == 1
    cells = [c.strip() for c in paired[0].strip("|").split("|")]
    diff0 = stt["heldout"]["student_loss"] - dense["heldout"]["student_loss"]
    assert cells[1] == "2" and float(cells[2]) == pytest.approx(diff0 + 0.15, abs=1e-3)
    low, high = (float(x) for x in cells[4].strip("[]").split(","))
    half = 12.706 * 0.15  # t_{0.975,1} × SE, SE = sd/√2 = 0.3/√2/√2
    assert (low, high) == pytest.approx((diff0 + 0.15 - half, diff0 + 0.15 + half), abs=2e-3)
    assert "`mod`: no seed finished" in readme and "`stt`: seeds [1] missing" not in readme
    # The test table pairs by seed and by window: Δ is the mean over both seeds, the interval brackets it.
    test_rows = [line for line in readme.split("## Test set")[1].splitlines() if line.startswith("| `stt`")]
    cells = [c.strip() for c in test_rows[0].strip("|").split("|")]
    test_diff0 = stt["test"]["student_loss"] - dense["test"]["student_loss"]
    assert cells[1] == "2" and cells[3] == f"{test_diff0 + 0.15:+.3f} (n 2)"
    low, high = (float(x) for x in cells[4].strip("[]").split(","))
    assert low < test_diff0 + 0.15 < high and high - low >= 0.3 - 1e-3  # the seeds alone differ by 0.3

    # The study is edited after `stt` finished: its results are stale — reported, never silently kept.
    write_study(workdir, seeds=[0, 1], runs=[RUNS[0], {**RUNS[1], "overrides": {"model.gate": "scaled"}}, RUNS[2]])
    proc = driver(workdir, "run", str(study), "--only", "stt", "--seeds", "0", "--no-aggregate")
    assert proc.returncode == 1 and "stt__seed0: STALE" in proc.stdout and "model" in proc.stdout, proc.stdout[-2000:]
    assert (out / "runs" / "stt__seed0.json").is_file()  # kept until asked
    proc = driver(workdir, "aggregate", str(out))
    readme = (out / "README.md").read_text()
    assert "Stale results" in readme and "`stt__seed0`: trained with other model" in readme
    assert "`stt`: no seed finished" in readme  # left out of the tables
    proc = driver(workdir, "run", str(study), "--only", "stt", "--seeds", "0", "--rerun-stale", "--dry-run")
    assert proc.returncode == 0 and "stale (model): retraining" in proc.stdout and "would train" in proc.stdout


@pytest.mark.slow
def test_study_eleuther_step_evaluates_the_final_checkpoint_offline(workdir):
    eleuther = {"config": str(TINY / "eval_stt.yaml"), "tasks": ["tiny_routed_mc"], "limit": None}
    study = write_study(workdir, seeds=[0], runs=[RUNS[1]], eleuther=eleuther, keep_checkpoints=False)
    proc = driver(workdir, "run", str(study))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((workdir / "out" / "runs" / "stt__seed0.json").read_text())
    el = result["eleuther"]
    assert el["tasks"] == ["tiny_routed_mc"] and 0 <= el["results"]["tiny_routed_mc"]["acc"] <= 1
    assert el["mc_acc"] == el["results"]["tiny_routed_mc"]["acc"]
    assert result["wall_time_s"]["eleuther"] > 0
    # The eval config is the run's model on its final checkpoint, evaluated with the template's settings.
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(el["config"])
    assert cfg.model.gate == "straight_through" and cfg.checkpointer.checkpoint_dir.endswith("stt__seed0/epoch_0")
    assert Path(cfg.include_path).is_absolute() and Path(cfg.tokenizer.path).is_absolute()
    # nothing was fetched: the study's private HF cache holds only the gpt2 stand-in
    hub = workdir / "work" / "hf_home" / "hub"
    assert sorted(p.name for p in hub.iterdir() if p.name.startswith("models--")) == ["models--gpt2"]
    assert "| `stt` | 1/1 |" in (workdir / "out" / "README.md").read_text()
    # keep_checkpoints: False deleted the checkpoint once the JSON was written; a rerun still skips the run
    assert result["checkpoint_kept"] is False and not (workdir / "work" / "runs" / "stt__seed0" / "epoch_0").exists()
    proc = driver(workdir, "run", str(study), "--no-aggregate")
    assert proc.returncode == 0 and "done, skipped" in proc.stdout


@pytest.mark.slow
def test_killed_study_resumes_training_from_its_checkpoint(workdir):
    budget = {"max_steps_per_epoch": 12, "gradient_accumulation_steps": 1}
    study = write_study(workdir, seeds=[0], runs=[RUNS[1]], budget=budget, points=4)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.Popen([sys.executable, str(STUDY_PY), "run", str(study), "--no-aggregate"], cwd=workdir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    manifest = workdir / "work" / "runs" / "stt__seed0" / "epoch_0" / "checkpoint.json"
    deadline = time.time() + 300
    try:
        while not manifest.is_file():  # first checkpoint: step 3 of 12
            assert proc.poll() is None and time.time() < deadline, "the study ended before its first checkpoint"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its training subprocess, as a crash would
        proc.wait()
    killed_at = json.loads(manifest.read_text())["global_step"]
    assert killed_at < 12
    assert training_state(manifest.parent.parent) == "resume"

    proc = driver(workdir, "run", str(study))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((workdir / "out" / "runs" / "stt__seed0.json").read_text())
    attempts = result["train_attempts"]
    assert [a["mode"] for a in attempts] == ["fresh", "resume"] and attempts[0]["interrupted"]
    assert attempts[1]["returncode"] == 0
    assert result["wall_time_s"]["train"] == pytest.approx(sum(a["seconds"] for a in attempts))
    assert result["steps"] == 12 and result["curves"]["steps"] == list(range(1, 13))
    assert all(finite(v) for v in result["curves"]["series"]["tokens"])
    assert Path(attempts[1]["log"]).read_text().splitlines()[0].endswith("resume_from_checkpoint=true")
    # the resumed attempt continued after the checkpoint (its DiskLogger file starts there), it did not restart
    disk_logs = sorted((workdir / "work" / "runs" / "stt__seed0" / "logs").glob("log_*.txt"))
    assert len(disk_logs) == 2
    assert disk_logs[-1].read_text().startswith(f"Step {killed_at + 1} |")


def test_done_needs_marker_and_checkpoint_and_schedule_divides_steps(tmp_path):
    assert training_state(tmp_path / "absent") == "fresh"
    (tmp_path / "run").mkdir()
    assert training_state(tmp_path / "run") == "fresh"  # no run.json, no checkpoint
    (tmp_path / "run" / DONE_MARKER).write_text("{}")
    assert training_state(tmp_path / "run") == "fresh"  # marker, but the checkpoint was deleted
    (tmp_path / "run" / "epoch_0").mkdir()
    assert training_state(tmp_path / "run") == "done"
    assert [schedule_every(s, 4) for s in (1, 2, 3, 40, 100, 200, 7)] == [1, 1, 1, 10, 25, 50, 7]


def test_two_workers_writing_study_json_at_once_both_succeed(tmp_path, monkeypatch):
    # Workers of one study started side by side both write study.json. Here the second worker writes the whole
    # file between the first one's write and its rename (the interleaving that killed a real worker when both
    # used one temporary name): both writes must land, the last rename's content wins, and no temporary is left.
    target = tmp_path / "study.json"
    real_replace = os.replace
    interleaved = []

    def replace_after_the_other_worker(src, dst):
        if not interleaved:
            interleaved.append(src)
            write_json(target, {"worker": 2})
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_the_other_worker)
    umask = os.umask(0o022)  # the file gets a plain write's mode, whatever the shell's umask
    try:
        write_json(target, {"worker": 1})
    finally:
        os.umask(umask)
    assert interleaved and json.loads(target.read_text()) == {"worker": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.json"]
    assert target.stat().st_mode & 0o777 == 0o644


def test_seed_and_window_bootstrap_covers_text_sampling_and_seeds():
    import random
    import statistics

    # One seed, the same difference in every window: no spread at all.
    boot = seed_window_bootstrap([([2.0, 3.0, 4.0], [1.5, 2.5, 3.5])], resamples=500, seed=0)
    assert boot["mean"] == pytest.approx(0.5) and boot["interval"] == pytest.approx((0.5, 0.5))
    # Window noise only (one seed): about the normal interval of a mean of 400 windows with sd 1.
    rng = random.Random(0)
    noise = [rng.gauss(0, 1) for _ in range(400)]
    boot = seed_window_bootstrap([(noise, [0.0] * 400)], resamples=2000, seed=0)
    half = (boot["interval"][1] - boot["interval"][0]) / 2
    assert half == pytest.approx(1.96 * statistics.stdev(noise) / 20, rel=0.15)
    # Seed noise on top: two seeds 1.0 apart widen it to cover both.
    two = seed_window_bootstrap([(noise, [0.0] * 400), ([v + 1.0 for v in noise], [0.0] * 400)],
                                      resamples=2000, seed=0)
    assert two["interval"][1] - two["interval"][0] > 0.9 and two["mean"] == pytest.approx(sum(noise) / 400 + 0.5)
    with pytest.raises(ValueError, match="per-window losses of one length"):
        seed_window_bootstrap([([1.0, 2.0], [1.0])], resamples=10, seed=0)


def test_a_study_test_set_must_be_another_file_than_its_heldout(tmp_path):
    spec = {"name": "s", "out_dir": "out", "work_dir": "work", "seeds": [0], "heldout": {"file": "h.jsonl"},
            "test": {"file": "./h.jsonl", "windows": 4, "seq_len": 8, "spread": True}, "runs": []}
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(spec))
    with pytest.raises(StudyError, match=r"is the held-out \(validation\) file"):
        load_study(path, tmp_path)
    spec["test"] = {"file": "t.jsonl", "windows": 4}
    path.write_text(json.dumps(spec))
    with pytest.raises(StudyError, match=r"missing \['seq_len', 'spread'\]"):
        load_study(path, tmp_path)


def test_paired_t_interval_and_parsed_logs_and_tables_equal_hand_values(tmp_path):
    pd = paired_difference([1.0, 2.0, 3.0])
    assert pd["mean"] == 2.0 and pd["sd"] == 1.0 and pd["se"] == pytest.approx(1 / math.sqrt(3))
    assert pd["ci95"] == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    assert paired_difference([0.5])["ci95"] is None
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "log_100.txt").write_text("Step 1 | loss/lm:2.0 tokens:10 \nStep 2 | loss/lm:1.9 tokens:10 \n"
                                      "Step 2 | val/lm_loss_student:2.5 \nStep 3 | loss/lm:9.9 tokens:10 \n"
                                      "Step 4 | loss/lm:9.8 tokens:10 val/lm_loss_student:9.7 \n")  # interrupted
    (logs / "log_200.txt").write_text("Step 3 | loss/lm:1.8 tokens:12 routing/layer_1/selected_fraction:0.5 \n")
    rows = parse_disk_logs(logs)  # the resumed attempt from step 3 on: the interrupted one's step 4 is not done
    assert rows == {1: {"loss/lm": 2.0, "tokens": 10.0}, 2: {"loss/lm": 1.9, "tokens": 10.0, "val/lm_loss_student": 2.5},
                    3: {"loss/lm": 1.8, "tokens": 12.0, "routing/layer_1/selected_fraction": 0.5}}
    curves = curves_from_log(rows)
    assert curves["steps"] == [1, 2, 3] and curves["series"]["val/lm_loss_student"] == [None, 2.5, None]
    table = ("|    Tasks     |Version|Filter|n-shot| Metric |   |Value|   |Stderr|\n"
             "|--------------|------:|------|-----:|--------|---|----:|---|-----:|\n"
             "|tiny_routed_mc|      1|none  |     0|acc     |↑  | 0.25|±  |0.2500|\n"
             "|              |       |none  |     0|acc_norm|↑  | 0.50|±  |0.2887|\n")
    assert parse_eleuther_table(table) == {"tiny_routed_mc": {"acc": 0.25, "acc_stderr": 0.25, "acc_norm": 0.5,
                                                                    "acc_norm_stderr": 0.2887}}


def test_example_study_dry_run_plans_six_runs_without_training():
    """The shipped example study loads and plans its commands (no training)."""
    example = REPO / "experiments" / "studies" / "quickstart_pair.yaml"
    proc = subprocess.run([sys.executable, str(STUDY_PY), "run", str(example), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "would train" in line or "done, skipped" in line]
    assert len(lines) == 2 * 3
    assert "save_every_n_steps=10" in proc.stdout and "validation.every_n_steps=10" in proc.stdout


def test_study_names_of_baselines_and_claims_runs_must_be_runs(tmp_path):
    spec = {"name": "s", "out_dir": "out", "work_dir": "work", "seeds": [0], "heldout": {"file": "h.jsonl"},
            "baselines": ["dense"], "runs": [{"name": "dense", "config": "d.yaml"}, {"name": "stt", "config": "s.yaml"}]}
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps({**spec, "claims_runs": ["stt"]}))
    assert load_study(path, root=tmp_path)["claims_runs"] == ["stt"]
    path.write_text(json.dumps(spec))
    assert load_study(path, root=tmp_path)["claims_runs"] is None  # the plot then draws every SDT/STT run
    path.write_text(json.dumps({**spec, "claims_runs": ["stt", "sdt_50"], "baselines": ["layerdrop"]}))
    with pytest.raises(StudyError, match=r"baselines \['layerdrop'\] are not run names; "
                                               r"claims_runs \['sdt_50'\] are not run names"):
        load_study(path, root=tmp_path)
    path.write_text(json.dumps({**spec, "gaps": ["dense", "layerdrop_7"]}))
    with pytest.raises(StudyError, match=r"gaps \['layerdrop_7'\] are not run names"):
        load_study(path, root=tmp_path)


def _curve(seed, values_by_step):
    steps = sorted(values_by_step)
    return {"seed": seed, "curves": {"steps": steps, "series": {"val/lm_loss_student": [values_by_step[s] for s in steps]}}}


def test_gap_curves_pair_each_step_by_seed_and_skip_what_the_baseline_lacks():
    run = [_curve(0, {50: 4.0, 100: 3.8, 150: None}), _curve(1, {50: 4.2, 100: 3.9}), _curve(2, {50: 9.0})]
    base = [_curve(0, {50: 3.5, 100: 3.6, 150: 3.4}), _curve(1, {50: 3.6, 75: 3.0}), _curve(3, {50: 0.0})]
    steps, gaps, seeds = paired_curve_difference(run, base, "val/lm_loss_student")
    assert steps == [50, 100] and seeds == [2, 1]  # seed 2 has no baseline; step 150 was not logged by the run
    assert gaps == pytest.approx([((4.0 - 3.5) + (4.2 - 3.6)) / 2, 3.8 - 3.6])


def test_a_study_page_tables_and_plots_each_runs_gap_to_its_gaps_baselines_step_by_step(tmp_path):
    source = REPO / "experiments" / "attribution"
    shutil.copytree(source / "runs", tmp_path / "runs")
    spec = json.loads((source / "study.json").read_text())
    write_json(tmp_path / "study.json", {**spec, "gaps": ["dense", "layerdrop_6_distill_bias"]})
    readme = aggregate(tmp_path).read_text()
    _, runs = load_results(tmp_path)
    section = readme.split("## Gaps during training")[1].split("\n## ")[0]
    assert (tmp_path / "gaps.png").stat().st_size > 0 and "![gaps.png](gaps.png)" in section
    for base in ("dense", "layerdrop_6_distill_bias"):
        table = section.split(f"### against `{base}`")[1].split("\n### ")[0].split("![")[0]
        header, _, *rows = [line for line in table.splitlines() if line.startswith("|")]
        steps = [int(cell.split()[1]) for cell in header.strip("| ").split(" | ")[1:]]
        by_run = {row.split(" | ")[0].strip("| `"): row.strip("| ").split(" | ")[1:] for row in rows}
        assert base not in by_run and "stt_d6_bi10_all_fixedcrit_bias_rlr10" in by_run
        for name, cells in by_run.items():
            run_steps, gaps, seeds = paired_curve_difference(runs[name], runs[base], "val/lm_loss_student")
            expected = {s: f"{g:+.3f} ({n})" for s, g, n in zip(run_steps, gaps, seeds)}
            assert cells == [expected.get(s, "–") for s in steps], name
    write_json(tmp_path / "study.json", spec)  # no `gaps`: no section, no plot
    assert "## Gaps during training" not in aggregate(tmp_path).read_text()


def test_a_study_page_shows_the_runs_still_training_from_their_logs_when_asked(tmp_path, capsys):
    source = REPO / "experiments" / "attribution"
    shutil.copytree(source / "runs", tmp_path / "runs")
    spec = json.loads((source / "study.json").read_text())
    for run in spec["runs"]:  # the recorded study names configs by absolute path on the machine that ran it
        run["config"] = str(REPO / Path(run["config"]).relative_to(Path(spec["source"]).parents[2]))
    name = "stt_d6_bi10_all_fixedcrit_bias_rlr10"
    (tmp_path / "runs" / f"{name}__seed0.json").unlink()
    logs = tmp_path / "work" / "runs" / f"{name}__seed0" / "logs"
    logs.mkdir(parents=True)
    # An attempt that validated at 50 and 100 and was killed at 105 before its step-100 checkpoint landed, and the
    # attempt resumed from step 50's checkpoint, now at step 70.
    (logs / "log_100.txt").write_text("".join(f"Step {s} | loss/lm:4.0 tokens:1020 \n" for s in range(1, 106))
                                      + "Step 50 | val/lm_loss_student:4.80 \nStep 100 | val/lm_loss_student:4.70 \n")
    (logs / "log_200.txt").write_text("".join(f"Step {s} | loss/lm:4.0 tokens:1020 \n" for s in range(51, 71)))
    write_json(tmp_path / "study.json", {**spec, "work_dir": str(tmp_path / "work"), "gaps": ["dense"]})
    _, runs = load_results(tmp_path)
    assert name not in runs or all(r["seed"] != 0 for r in runs[name])
    plain = aggregate(tmp_path).read_text()
    assert "in training:" not in plain
    readme = aggregate(tmp_path, in_training=True).read_text()
    section = readme.split("## Gaps during training")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("|") and "in training:" in line)
    dense_50 = next(r for r in runs["dense"] if r["seed"] == 0)
    dense_50 = dict(zip(dense_50["curves"]["steps"], dense_50["curves"]["series"]["val/lm_loss_student"]))[50]
    assert row.startswith(f"| `{name} (seed 0, in training: step 70 of 200)` |")
    cells = row.strip("| ").split(" | ")[1:]
    assert f"{4.80 - dense_50:+.3f} (1)" in cells and len([c for c in cells if c != "–"]) == 1  # step 100 not redone
    # The in-training row is in no other table: the runs table still counts the seeds that finished.
    assert readme.split("## Gaps during training")[0] == plain.split("## Gaps during training")[0]

    # `study.py status` reads the same logs: the seeds that finished, the one training and its step, none waiting.
    from experiments.study import main as study_main

    capsys.readouterr()  # what aggregate printed
    study_main(["status", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"  {name}: finished [1, 2]; seed 0 training (step 70 of 200)\n" in out
    assert "  dense: finished [0]; not started [1, 2]\n" in out
    finished = sum(len(results) for results in runs.values())
    waiting = len(spec["runs"]) * len(spec["seeds"]) - finished - 1
    assert f": {finished} finished, 1 training, {waiting} not started of {len(spec['runs'])} runs" in out.splitlines()[0]
    assert study_main(["status", str(tmp_path / "runs")]) == 2 and "study.json not found" in capsys.readouterr().err


def _scored(seed, windows, flops=0.8):
    return {"seed": seed, "compute": {"forward_flops_ratio": flops},
            "test": {"student_loss": sum(windows) / len(windows), "window_losses": windows}}


def test_a_comparison_ranks_its_arms_on_the_test_windows_and_measures_each_against_the_best():
    import random

    rng = random.Random(0)
    noise = {seed: [rng.gauss(0, 0.3) for _ in range(64)] for seed in (0, 1)}  # the same text for every arm

    def arm(offset, jitter=0.0, seeds=(0, 1)):
        return [_scored(s, [3.0 + offset + n + rng.gauss(0, jitter) for n in noise[s]]) for s in seeds]

    runs = {"surprise": arm(0.00), "mod": arm(0.05, jitter=0.05), "random": arm(0.20), "close": arm(0.002, jitter=0.05),
            "layerdrop": arm(-0.10, seeds=(0,))}
    comparison = {"title": "one shape", "ranked": {"(d) random": "random", "(a) surprise": "surprise", "(c) MoD": "mod"},
                  "beside": {"(e) no routing": "layerdrop"}}
    lines = comparison_section(comparison, runs, expected_seeds=[0, 1])
    rows = [line.split(" | ") for line in lines if line.startswith("| (")]
    assert [row[0].lstrip("| ") for row in rows] == ["(a) surprise", "(c) MoD", "(d) random",
                                                     "(e) no routing (beside, not ranked)"]
    assert rows[0][5] == "best"
    # Each Δ is the paired mean over seeds and windows, its interval far from 0 where the arms differ by 0.05.
    mod_delta = sum(b - a for s in (0, 1) for a, b in zip(runs["surprise"][s]["test"]["window_losses"],
                                                          runs["mod"][s]["test"]["window_losses"])) / 128
    assert abs(mod_delta - 0.05) < 0.02
    assert rows[1][5] == f"{mod_delta:+.3f} (n 2)" and rows[2][5] == "+0.200 (n 2)" and rows[3][5] == "-0.100 (n 1)"
    low, high = (float(v) for v in rows[1][6].strip(" |[]").split(", "))
    assert 0 < low < mod_delta < high < 0.1
    verdict = next(line for line in lines if line.startswith("Best:"))
    assert "(a) surprise" in verdict and f"runner-up (c) MoD by {mod_delta:.3f} nats" in verdict
    assert "excludes 0" in verdict
    assert "Partial: fewer than 2 seeds scored for `layerdrop` (1)." in lines
    # An arm within noise of the best is named as not separated from it.
    comparison["ranked"] = {"(a) surprise": "surprise", "(b) close": "close"}
    verdict = next(line for line in comparison_section(comparison, runs, [0, 1]) if line.startswith("Best:"))
    assert "includes 0: not separated" in verdict
    assert comparison_section({"title": "t", "ranked": {"x": "unscored", "y": "none"}}, runs, [0])[-2] == (
        "No ranked arm has been scored on the test windows yet.")


def test_a_comparison_measures_each_arm_against_the_layer_dropping_line_at_its_own_flops():
    import random

    rng = random.Random(1)
    noise = {seed: [rng.gauss(0, 0.3) for _ in range(64)] for seed in (0, 1)}

    def arm(offset, flops, seeds=(0, 1)):
        return [_scored(s, [3.0 + offset + n for n in noise[s]], flops) for s in seeds]

    # The line: 4.0 at 0.70 FLOPs, 3.6 at 0.80 → 3.76 at 0.76. "under" sits 0.05 below the line at its cost,
    # "over" 0.05 above; "cheap" costs less than every run of the line and is measured against the cheapest.
    runs = {"drop_more": arm(1.0, 0.70), "drop_less": arm(0.6, 0.80), "under": arm(0.71, 0.76),
            "over": arm(0.81, 0.76), "cheap": arm(0.95, 0.65), "dear": arm(0.0, 0.90)}
    comparison = {"title": "one level", "ranked": {"(a) under": "under", "(c) over": "over", "(d) cheap": "cheap"},
                  "beside": {"drop 7": "drop_less", "dense-ish": "dear"}, "line": ["drop_less", "drop_more"]}
    lines = comparison_section(comparison, runs, expected_seeds=[0, 1])
    def table(lines):
        return {row[1].strip("`"): row for row in (line.split(" | ") for line in lines if line.startswith("| "))
                if row[1].startswith("`")}

    rows = table(lines)
    assert rows["under"][7] == "-0.050 (n 2)" and rows["over"][7] == "+0.050 (n 2)"
    assert rows["cheap"][7] == "-0.050 (n 2)"  # against drop_more (4.0), not extrapolated
    assert rows["drop_less"][7] == "on the line" and rows["dear"][7] == "–"  # dearer than every run: no verdict
    low, high = (float(v) for v in rows["under"][8].strip(" |[]").split(", "))
    assert low <= -0.050 <= high and high < 0  # the windows are shared: the line's noise cancels
    verdict = next(line for line in lines if line.startswith("Against the line"))
    assert "(a) under (`under`, 0.760) is -0.050 nats" in verdict and "below the line" in verdict
    # One recipe alone (nothing to rank it against) still gets its verdict against the line.
    alone = comparison_section({"title": "a recipe", "ranked": {"the recipe": "over"}, "line": ["drop_less", "drop_more"]},
                               runs, [0, 1])
    assert not any(line.startswith("Best:") for line in alone)
    assert any(line.startswith("Against the line") and "+0.050 nats" in line and "above the line" in line
               for line in alone)
    # A seed on which the line lacks one of its runs is measured against nothing, not against a shorter line.
    runs["drop_more"] = runs["drop_more"][:1]
    rows = table(comparison_section(comparison, runs, [0, 1]))
    assert rows["under"][7] == "-0.050 (n 1)"
    verdict = next(line for line in comparison_section(comparison, runs, [0, 1]) if line.startswith("Against"))
    assert "one seed" in verdict


def test_the_line_interpolates_window_by_window_and_takes_the_stronger_twin():
    from experiments.stats import line_at

    line = [(0.8, [3.0, 4.0]), (0.7, [4.0, 5.0]), (0.8, [3.5, 3.5])]  # two runs at 0.8: the lower mean (3.5) wins
    assert line_at(line, 0.75) == pytest.approx([3.5, 4.5])
    assert line_at(line, 0.8) == pytest.approx([3.0, 4.0])
    assert line_at(line, 0.6) == pytest.approx([4.0, 5.0])  # cheaper than every run: the cheapest run
    assert line_at(line, 0.9) is None and line_at([], 0.5) is None


def aggregated_copy(study: str, tmp_path: Path):
    """(page text, spec, runs) of a committed study's run files aggregated afresh in ``tmp_path``."""
    source = REPO / "experiments" / study
    shutil.copytree(source / "runs", tmp_path / "runs")
    shutil.copy(source / "study.json", tmp_path / "study.json")
    readme = aggregate(tmp_path).read_text()
    return (readme, *load_results(tmp_path))


def test_committed_attribution_verdicts_are_the_paired_test_differences_of_their_run_files(tmp_path):
    readme, spec, runs = aggregated_copy("attribution", tmp_path)
    section = readme.split("## Verdicts on the test windows")[1].split("\n## ")[0]
    for comparison in spec["comparisons"]:
        table = section.split(f"### {comparison['title']}")[1].split("\n### ")[0]
        rows = {line.split(" | ")[1].strip("`"): line.split(" | ") for line in table.splitlines() if line.startswith("| ")
                and "`" in line.split(" | ")[1]}
        losses = {run: {r["seed"]: r["test"]["window_losses"] for r in runs.get(run, [])} for run in rows}
        if not any(run in rows for run in comparison["ranked"].values()):  # a level not scored yet
            assert "No ranked arm has been scored on the test windows yet." in table
            continue
        best = min((run for run in comparison["ranked"].values() if losses.get(run)), key=lambda run: sum(
            sum(w) / len(w) for w in losses[run].values()) / len(losses[run]))
        assert rows[best][5] == "best"
        for run, row in rows.items():
            seeds = sorted(set(losses[run]) & set(losses[best]))
            if run == best or not seeds:
                continue
            delta = sum(sum(a - b for a, b in zip(losses[run][s], losses[best][s])) / len(losses[run][s])
                        for s in seeds) / len(seeds)
            assert row[5] == f"{delta:+.3f} (n {len(seeds)})", (run, row)
        # Against the line: per seed on which every line run was scored, the line interpolated at the arm's FLOPs.
        line = comparison["line"]
        line_results = {run: {r["seed"]: r for r in runs.get(run, [])} for run in line}
        for run in comparison["ranked"].values():
            diffs = []
            for r in runs.get(run, []):
                if not all(r["seed"] in line_results[name] for name in line):
                    continue
                flops = r["compute"]["forward_flops_ratio"]
                if flops > max(line_results[name][r["seed"]]["compute"]["forward_flops_ratio"] for name in line):
                    continue  # dearer than every run of the line: no verdict
                points = sorted((line_results[name][r["seed"]]["compute"]["forward_flops_ratio"],
                                 line_results[name][r["seed"]]["test"]["window_losses"]) for name in line)
                (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if a[0] <= flops <= b[0]),
                                          (points[0], points[0]))
                weight = 0.0 if x1 == x0 else (flops - x0) / (x1 - x0)
                on_line = [a + weight * (b - a) for a, b in zip(y0, y1)]
                diffs.append(sum(a - b for a, b in zip(r["test"]["window_losses"], on_line)) / len(on_line))
            expected = f"{sum(diffs) / len(diffs):+.3f} (n {len(diffs)})" if diffs else "–"
            assert rows[run][7] == expected, (run, rows[run])


def test_study_comparisons_must_rank_two_runs_of_the_study(tmp_path):
    spec = {"name": "s", "out_dir": "out", "work_dir": "work", "seeds": [0], "heldout": {"file": "h.jsonl"},
            "runs": [{"name": "dense", "config": "d.yaml"}, {"name": "stt", "config": "s.yaml"},
                     {"name": "ld", "config": "l.yaml"}]}
    path = tmp_path / "study.yaml"
    good = [{"title": "t", "ranked": {"a": "stt", "b": "dense"}},
            {"title": "one recipe against a line", "ranked": {"a": "stt"}, "line": ["dense", "ld"]}]
    path.write_text(json.dumps({**spec, "comparisons": good}))
    assert load_study(path, root=tmp_path)["comparisons"] == good
    for comparisons, message in [
        ([{"title": "t", "ranked": {"a": "stt", "b": "mod_50"}}], r"comparisons\[0\] \['mod_50'\] are not run names"),
        ([{"title": "t", "ranked": {"a": "stt"}}], r"ranked must map two or more labels"),
        ([{"title": "t", "ranked": {"a": "stt"}, "line": ["dense"]}], r"line must list two or more"),
        ([{"title": "t", "ranked": {"a": "stt", "b": "dense"}, "beside": {"c": "stt"}}], r"names a run twice"),
        ([{"title": "t", "ranked": {"a": "stt", "b": "dense"}, "line": ["dense"]}], r"line must list two or more"),
        ([{"title": "t", "ranked": {"a": "stt", "b": "dense"}, "line": ["dense", "ld_9"]}], r"\['ld_9'\] are not run"),
        ({"title": "t"}, r"comparisons must be a list"),
    ]:
        path.write_text(json.dumps({**spec, "comparisons": comparisons}))
        with pytest.raises(StudyError, match=message):
            load_study(path, root=tmp_path)


def test_committed_frontier_results_aggregate_to_paired_tables_of_their_own_numbers(tmp_path):
    # The real study's run files: each paired row is the per-seed difference of the two runs' JSONs, and a
    # run with no seed in common with a baseline gets no row of dashes but one line naming it.
    readme, _, runs = aggregated_copy("frontier", tmp_path)
    loss = lambda r: r["heldout"]["student_loss"]  # noqa: E731
    expected_names = [r["name"] for r in json.loads((tmp_path / "study.json").read_text())["runs"]]
    for base in ("layerdrop_7", "random_50"):
        section = readme.split(f"## Paired differences against `{base}`")[1].split("\n## ")[0]
        rows = {line.split("|")[1].strip(" `"): line.split("|") for line in section.splitlines() if line.startswith("| `")}
        base_loss = {r["seed"]: loss(r) for r in runs[base]}
        for name, results in runs.items():
            diffs = [loss(r) - base_loss[r["seed"]] for r in results if r["seed"] in base_loss]
            if name == base:
                continue
            assert name in rows, (base, name)
            assert int(rows[name][2]) == len(diffs)
            assert float(rows[name][3]) == pytest.approx(sum(diffs) / len(diffs), abs=6e-4)
        unpaired = [n for n in expected_names if n != base and n not in runs]
        assert not set(unpaired) & set(rows)
        note = f"No seed paired with `{base}` yet: " + ", ".join(f"`{n}`" for n in unpaired) + "."
        assert (note in section) if unpaired else ("No seed paired" not in section)


def test_a_model_key_added_after_a_run_finished_leaves_it_current_only_while_off():
    # The committed results trained before routed configs carried `dropped_layers`; `[]` (off) keeps them
    # current, while a study that now drops a layer makes the same result stale.
    spec = load_study(REPO / "experiments" / "frontier" / "study.yaml", root=REPO)
    run = next(r for r in spec["runs"] if r["name"] == "stt_50")
    result = json.loads((REPO / "experiments" / "frontier" / "runs" / "stt_50__seed0.json").read_text())
    assert "dropped_layers" not in result["config"]["model"]
    assert planned_config(spec, run, 0, Path(result["output_dir"]))["model"]["dropped_layers"] == []
    assert stale_keys(spec, run, result) == []
    dropping = {**run, "overrides": {**run["overrides"], "model.dropped_layers": [14]}}
    assert stale_keys(spec, dropping, result) == ["model"]


def _write_hand_made_runs(folder, table):
    """``folder/runs/<name>__seed<k>.json`` for each ``name: (variant, FLOPs ratio, losses per seed[, teacher
    losses per seed])``: just the fields targets.py reads."""
    (folder / "runs").mkdir()
    for name, (variant, ratio, losses, *teacher) in table.items():
        for seed, loss in enumerate(losses):
            heldout = {"student_loss": loss, "teacher_loss": teacher[0][seed] if teacher else None}
            (folder / "runs" / f"{name}__seed{seed}.json").write_text(json.dumps(
                {"name": name, "seed": seed, "variant": variant, "compute": {"forward_flops_ratio": ratio},
                 "heldout": heldout}))


def test_frontier_targets_need_three_seeds_two_standard_errors_and_the_same_flops(tmp_path):
    # Hand-made run files at ≈ 0.81 of dense: per-seed losses chosen so each verdict is known in advance. The
    # baselines are compared at the candidate's own FLOPs, linear between the two baseline runs (or dense at
    # 1.0) that bracket them.
    table = {  # name: (variant, FLOPs ratio, loss per seed[, teacher loss per seed])
        "dense": ("dense", 1.0, [4.0, 4.1, 4.2]),
        "layerdrop_7": ("layerdrop", 0.81, [4.5, 4.6, 4.7]),
        "layerdrop_4": ("layerdrop", 0.89, [4.1, 4.2, 4.3]),  # layer dropping: −5 nats per unit of FLOPs here
        "random_50": ("random", 0.81, [5.5, 5.6, 5.7]),
        "stt_papers_50": ("stt", 0.81, [6.0, 6.1, 6.2]),
        # at 0.80, below layerdrop_7's FLOPs: compared with layerdrop_7 itself; − 4.5, 4.6, 4.7: −0.10, −0.08,
        # −0.12 → met. Its teacher: +0.10, +0.05, +0.05 → the (diagnostic) teacher loses beyond 2 se.
        "stt_a": ("stt", 0.80, [4.40, 4.52, 4.58], [4.60, 4.65, 4.75]),
        "mod_a": ("mod", 0.80, [4.41, 4.50, 4.60]),      # stt_a − mod_a: −0.01, +0.02, −0.02 → tie
        # 0.05 nats below layerdrop_7 on every seed, but at 0.83: layer dropping there is 4.40, 4.50, 4.60, so
        # it trails by +0.05 (the nominal comparison would have called it met)
        "stt_dear": ("stt", 0.83, [4.45, 4.55, 4.65]),
        "stt_new": ("stt", 0.80, [4.0]),                 # best by its margin, one seed: not yet
        "mod_far": ("mod", 0.60, [9.0, 9.0, 9.0]),       # at no level
        # ≈ 0.90, where the 0.10 bar is judged on the lowest loss at ≤ 0.90 FLOPs among recipes that beat both
        # baselines. stt_b: furthest below layer dropping (4.175, 4.275, 4.375 at 0.875: −0.065), +0.11 from dense
        "stt_b": ("stt", 0.875, [4.11, 4.22, 4.30]),
        # stt_c: −0.022 ± 0.003 below layer dropping at 0.895 (met), +0.073 from dense: the one judged
        "stt_c": ("stt", 0.895, [4.07, 4.17, 4.28]),
        # lower still, but layer dropping at 0.899 matches it (+0.075 ± 0.058): not eligible
        "stt_tie": ("stt", 0.899, [4.05, 4.20, 4.25]),
        # +0.02 from dense and below layer dropping, but above 0.90 of dense FLOPs: not eligible
        "stt_far": ("stt", 0.92, [4.02, 4.12, 4.22]),
    }
    _write_hand_made_runs(tmp_path, table)
    markdown = targets.targets_table(tmp_path)
    rows, rows_90 = {}, {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and cells[1] in ("0.81", "0.90"):
            (rows if cells[1] == "0.81" else rows_90)[(cells[2], cells[3])] = (cells[4], cells[5])
    assert rows_90[("within 0.10 nats of dense (lowest loss at ≤ 0.90 FLOPs among the recipes that beat both "
                    "baselines)", "stt_c − dense (at 0.895)")] == ("+0.073 ± 0.003 se (n = 3)", "met")
    assert rows_90[("best < layer dropping at its FLOPs by > 2 se",
                    "stt_b − layer dropping at 0.875 (layerdrop_7 0.810 ↔ layerdrop_4 0.890)")][1] == "met"
    drop_at = "layer dropping at 0.800 (layerdrop_7 (0.810, more FLOPs))"
    assert rows[("best < layer dropping at its FLOPs by > 2 se", f"stt_new − {drop_at}")][1] == "not yet (1/3 seeds)"
    numbers, verdict = rows[("best with 3 seeds < layer dropping at its FLOPs by > 2 se", f"stt_a − {drop_at}")]
    assert verdict == "met" and numbers.startswith("-0.100 ± 0.012 se (n = 3)")
    assert rows[("best with 3 seeds < random routing at its FLOPs by > 2 se",
                 "stt_a − random routing at 0.800 (random_50 (0.810, more FLOPs))")][1] == "met"
    assert rows[("diagnostic: its teacher (not deployed) vs layer dropping", f"stt_a teacher − {drop_at}")] == (
        "+0.067 ± 0.017 se (n = 3)", "answered: layer dropping lower")
    assert not any(run.startswith("stt_new teacher") for _, run in rows)  # no teacher loss, no diagnostic row
    # The price of compute, (loss − dense) / (1 − FLOPs) per seed: layerdrop_7 (0.5 / 0.19 on every seed) against
    # stt_a ((0.40, 0.42, 0.38) / 0.20 → 2.0, 2.1, 1.9): the cheaper saving, whichever is lower
    price_rows = markdown.split("The price of compute")[1].splitlines()
    prices = {line.split("`")[1]: line.split("|")[3].strip() for line in price_rows if line.startswith("| `")}
    assert prices["layerdrop_7"] == "+2.632 ± 0.000 se (n = 3)" and prices["stt_a"] == "+2.000 ± 0.058 se (n = 3)"
    assert "dense" not in prices and "random_50" not in prices and prices["stt_new"].endswith("(n = 1)")
    # stt_dear is lower than stt_a on no seed's margin, so it is never the best; measured directly, it loses:
    _, runs = load_results(tmp_path)
    losses = {name: targets.by_seed(results) for name, results in runs.items()}
    values, where = targets.matched("stt_dear", ["dense", "layerdrop_7", "layerdrop_4"], runs, losses)
    assert where == "at 0.830 (layerdrop_7 0.810 ↔ layerdrop_4 0.890)"
    assert [round(values[s], 6) for s in range(3)] == [4.4, 4.5, 4.6]
    # A teacher is charged its own selection, top-k at γ: stt_bi20_all's seed-0 student under-ran its budget
    # (0.705 of dense), its teacher did not (γ 0.5 on 20 layers: 0.763 by the closed form).
    committed = load_results(REPO / "experiments" / "frontier")[1]["stt_bi20_all"]
    assert targets.flops_by_seed(committed)[0] == pytest.approx(0.705, abs=1e-3)
    assert targets.teacher_flops_by_seed(committed)[0] == pytest.approx(0.763, abs=1e-3)
    # above every layer-dropping run, dense is the family's point at 1.0
    assert targets.family_at([(0.89, 4.1), (1.0, 4.0), (0.81, 4.5)], 0.945) == pytest.approx(4.05)
    # the same layers dropped with and without distillation: the family takes the lower loss at those FLOPs
    with_distilled = [(0.81, 4.5), (0.89, 4.1), (0.81, 4.3)]
    assert targets.family_at(with_distilled, 0.81) == pytest.approx(4.3)
    assert targets.family_at(with_distilled, 0.85) == pytest.approx(4.2)
    assert targets.family_at(with_distilled, 0.80) == pytest.approx(4.3)
    # ... and the label names both runs of that point, not whichever sorts first
    committed_runs = load_results(REPO / "experiments" / "frontier")[1]
    committed_losses = {name: targets.by_seed(results) for name, results in committed_runs.items()}
    family = ["dense", "layerdrop_7", "layerdrop_7_distill", "layerdrop_10", "layerdrop_10_distill"]
    _, where = targets.matched("stt_d4_bi7_all_rlr10", family, committed_runs, committed_losses)
    assert where == "at 0.806 (layerdrop_10 / layerdrop_10_distill 0.733 ↔ layerdrop_7 / layerdrop_7_distill 0.813)"
    # Technique ablations: each `<variant>_50_<technique>` against `<variant>_50` on the seeds both have; other
    # `_50_` runs (the prior-factor ablation) are not techniques.
    ablations = targets.technique_ablations(committed_runs, committed_losses)
    row = next(line for line in ablations if line.startswith("| `") and "_50_all` |" in line)  # MoD's or STT's
    name = row.split("`")[1]
    with_all, without = committed_losses[name], committed_losses[name.replace("_50_all", "_50")]
    common = sorted(set(with_all) & set(without))
    expected = sum(with_all[seed] - without[seed] for seed in common) / len(common)
    assert f"| {expected:+.3f}" in row and f"(n = {len(common)}) |" in row
    assert not any("prior0_25" in line for line in ablations)
    # papers → dense gap closed by the best recipe (stt_new, seed 0 only): (6.0 − 4.0) / (6.0 − 4.0) = 100 %
    assert rows[("closes ≥ 70 % of papers→dense gap", "stt_new vs stt_papers_50, dense")] == (
        "100% closed (n = 1)", "not yet (1/3 seeds)")
    # stt_a: (6.0 − 4.40) / 2, (6.1 − 4.52) / 2, (6.2 − 4.58) / 2 → 80 % on three seeds
    assert rows[("closes ≥ 70 % of papers→dense gap", "stt_a vs stt_papers_50, dense")] == ("80% closed (n = 3)", "met")
    assert rows[("surprise vs MoD (answered either way)", "stt_new − mod_a")][1] == "not yet (1/3 seeds)"
    assert rows[("surprise vs MoD, same recipe", "stt_a − mod_a")][1] == "answered: no difference beyond 2 se"
    assert "Off budget" in markdown and "`mod_far` 0.600" in markdown


def test_frontier_targets_read_dense_papers_and_the_ablations_from_the_studys_claims(tmp_path):
    # The roles targets.py reads come from the study's claims: section, not from run names: here the dense control,
    # the papers' setting and one ablation pair are named otherwise; the papers' run is never a candidate recipe.
    _write_hand_made_runs(tmp_path, {"control": ("dense", 1.0, [4.0, 4.1, 4.2]),
                                     "layerdrop_7": ("layerdrop", 0.81, [4.5, 4.6, 4.7]),
                                     "setting": ("stt", 0.81, [4.3, 4.4, 4.5]),
                                     "stt_x": ("stt", 0.80, [4.6, 4.7, 4.8]),
                                     "stt_x_plus": ("stt", 0.80, [4.5, 4.6, 4.7]),
                                     "stt_50": ("stt", 0.80, [5.0, 5.0, 5.0]),
                                     "stt_50_kv": ("stt", 0.80, [4.9, 4.9, 4.9])})
    for run in (tmp_path / "runs").iterdir():  # the ablation table also reads KV bytes
        result = json.loads(run.read_text())
        result["compute"]["kv_bytes_ratio"] = 0.75
        run.write_text(json.dumps(result))
    claims_section = {"dense": "control", "papers": "setting", "ablations": {"stt_x": {"kv": "stt_x_plus"}}}
    (tmp_path / "study.json").write_text(json.dumps({"claims": claims_section}))
    markdown = targets.targets_table(tmp_path)
    assert "| 0.81 | closes ≥ 70 % of papers→dense gap | stt_x_plus vs setting, control | " in markdown
    assert not any(line.split("|")[3].strip().startswith("setting") for line in markdown.splitlines()
                   if line.startswith("| 0.81 | best"))  # lower than every recipe, but the papers' setting
    ablations = [line for line in markdown.split("Technique ablations")[1].split("The price of compute")[0].splitlines()
                 if line.startswith("| `")]
    assert ablations == ["| `stt_x_plus` | skipped tokens write K/V | 0.800 vs 0.800 | 0.750 | -0.100 ± 0.000 se "
                         "(n = 3) | answered: the technique lowers the loss |"]  # stt_50_kv is not named: no row
    prices = markdown.split("The price of compute")[1]
    assert "`control`" not in prices and "`stt_x` | 0.800 | +3.000" in prices  # (4.6 − 4.0) / 0.2, paired with control
    # a claims section that names no papers' run is refused by name; an unknown technique too
    (tmp_path / "study.json").write_text(json.dumps({"claims": {"dense": "control"}}))
    with pytest.raises(ValueError, match=r"names no run for \['papers'\]"):
        targets.targets_table(tmp_path)
    (tmp_path / "study.json").write_text(json.dumps({"claims": {**claims_section,
                                                                "ablations": {"stt_x": {"kv2": "stt_x_plus"}}}}))
    with pytest.raises(ValueError, match=r"claims.ablations names techniques \['kv2'\]"):
        targets.targets_table(tmp_path)
    # the frontier study names its own: the nine technique ablations of the papers' setting
    frontier = targets.study_claims(REPO / "experiments" / "frontier")
    assert (frontier["dense"], frontier["papers"]) == ("dense", "stt_papers_50")
    assert sorted(run for runs in frontier["ablations"].values() for run in runs.values()) == [
        "mod_50_all", "mod_50_curr", "mod_50_distill", "mod_50_kv",
        "stt_50_all", "stt_50_curr", "stt_50_distill", "stt_50_kv", "stt_50_pred"]


def test_a_claims_section_names_runs_and_ablations_of_runs(tmp_path):
    path = tmp_path / "study.yaml"
    spec = {"name": "s", "out_dir": "o", "work_dir": "w", "seeds": [0], "heldout": {"file": "h", "windows": 1,
            "seq_len": 8}, "runs": [{"name": "a", "config": "c.yaml"}, {"name": "b", "config": "c.yaml"}]}
    path.write_text(json.dumps({**spec, "claims": {"dense": "a", "ablations": {"a": {"kv": "b"}}}}))
    assert load_study(path, root=tmp_path)["claims"]["ablations"] == {"a": {"kv": "b"}}
    path.write_text(json.dumps({**spec, "claims": {"dense": "a", "ablations": {"a": {"kv": "nope"}}}}))
    with pytest.raises(StudyError, match=r"claims \['nope'\] are not run names"):
        load_study(path, root=tmp_path)
    path.write_text(json.dumps({**spec, "claims": {"dense": "a", "ablations": {"a": ["b"]}}}))
    with pytest.raises(StudyError, match=r"claims.ablations must map a run to \{technique: the run with it\}"):
        load_study(path, root=tmp_path)
    path.write_text(json.dumps({**spec, "claims": {"dense": ["a"]}}))
    with pytest.raises(StudyError, match=r"claims must map roles to run names"):
        load_study(path, root=tmp_path)


def test_frontier_targets_check_another_study_folder_from_the_command_line(tmp_path):
    # `targets.py --study DIR --write` judges that study's runs (e.g. the 200-step budget study) and writes its
    # targets.md there, not into the frontier folder; a folder without runs/ is refused by name.
    _write_hand_made_runs(tmp_path, {"dense": ("dense", 1.0, [4.00, 4.10, 4.20]),
                                     "layerdrop_4": ("layerdrop", 0.893, [4.08, 4.18, 4.28]),
                                     "stt_x": ("stt", 0.895, [4.07, 4.19, 4.27])})
    frontier_table = (REPO / "experiments" / "frontier" / "targets.md").read_text()
    script = REPO / "experiments" / "frontier" / "targets.py"
    done = subprocess.run([sys.executable, str(script), "--study", str(tmp_path), "--write"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = (tmp_path / "targets.md").read_text()
    assert f"targets.py --study {tmp_path} --write" in written
    # no random-routing run, so no recipe qualifies: the bar is judged on the best by margin (+0.07, +0.09, +0.07
    # from dense), in the words alone, and the row says so
    assert ("| 0.90 | within 0.10 nats of dense (best by margin: no recipe at ≤ 0.90 FLOPs beats both baselines on "
            "3 seeds) | stt_x − dense | +0.077 ± 0.007 se (n = 3) | met |") in written
    assert "| 0.90 | best < random routing at its FLOPs by > 2 se | stt_x | no random run yet | not yet |" in written
    # ... while it only ties layer dropping at its FLOPs (interpolated towards dense at 1.0)
    assert ("| stt_x − layer dropping at 0.895 (layerdrop_4 0.893 ↔ dense 1.000) | -0.002 ± 0.007 se (n = 3) "
            "| not met |") in written
    assert (REPO / "experiments" / "frontier" / "targets.md").read_text() == frontier_table
    refused = subprocess.run([sys.executable, str(script), "--study", str(tmp_path / "nowhere")], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and f"--study {tmp_path / 'nowhere'}: no runs/ folder there" in refused.stderr


def test_frontier_pages_quote_the_default_study_without_study_however_its_path_is_spelt(monkeypatch):
    # The written page quotes the command that regenerates it; a relative or roundabout path to the frontier
    # folder is still the default study (no --study), while another folder is named as given.
    frontier = REPO / "experiments" / "frontier"
    monkeypatch.chdir(REPO)
    for spelt in (frontier, Path("experiments/frontier"), Path("experiments/budget_cpu200/../frontier/")):
        assert targets.command_line("claims.py", spelt) == "python experiments/frontier/claims.py"
    assert (targets.command_line("targets.py", Path("experiments/budget_cpu200"))
            == "python experiments/frontier/targets.py --study experiments/budget_cpu200")


def test_frontier_claims_get_the_verdicts_their_numbers_imply(tmp_path):
    # Hand-made run files whose curves and held-out reports are chosen so each claim's verdict is known.
    (tmp_path / "runs").mkdir()
    steps = list(range(1, 31))

    def curve(end):  # training loss: from 7.0 down (or up) to `end` over 15 steps, then flat
        return [7.0 + (end - 7.0) * i / 14 for i in range(15)] + [end] * 15

    def write(name, variant, seed, lm_end=5.0, surprise=None, shift=None, fractions=None, agreement=None, loss=5.0,
              executed_end=None, out=tmp_path):
        series = {"loss/lm": curve(lm_end)}
        if executed_end is not None:  # the teacher's executed fraction falls from 1.0 to `executed_end` on layer 1
            series["routing/layer_1/teacher_fraction"] = [1.0] * 5 + [executed_end] * 25
        if surprise is not None:  # {layer: (D_st, D_ch)} held-out; the raw L_pred is their mean D_ch
            series["loss/pred"] = [sum(d_ch for _, d_ch in surprise.values()) / len(surprise)] * len(steps)
        if shift is not None:  # CE − CU share moves by `shift` from the first 10 steps to the last 10
            for layer in (1, 3):
                series[f"routing/layer_{layer}/teacher_ce_share"] = [0.5] * 10 + [0.5] * 10 + [0.5 + shift / 2] * 10
                series[f"routing/layer_{layer}/teacher_cu_share"] = [0.5] * 10 + [0.5] * 10 + [0.5 - shift / 2] * 10
        layers = {}
        for layer, fraction in (fractions or {}).items():
            layers[str(layer)] = {"teacher/teacher_fraction": fraction}
        for layer in (1, 3):
            if agreement is not None:
                layers.setdefault(str(layer), {})["teacher/agreement_accuracy"] = agreement
        for layer, (d_st, d_ch) in (surprise or {}).items():
            layers.setdefault(str(layer), {}).update({"teacher/d_st": d_st, "teacher/d_ch": d_ch})
        (out / "runs" / f"{name}__seed{seed}.json").write_text(json.dumps(
            {"name": name, "seed": seed, "variant": variant, "curves": {"steps": steps, "series": series},
             "layers": layers, "heldout": {"student_loss": loss}}))

    for seed in range(3):
        jitter = (-0.01, 0.02, 0.005)[seed]
        write("dense", "dense", seed, loss=4.0 + 0.1 * seed)
        write("mod_50", "mod", seed, lm_end=5.0 + 0.1 * seed, loss=5.5 + 0.1 * seed)
        # SDT trains like MoD (differences −0.01, +0.02, +0.005): "no worse" holds
        # Predictors: SDT leaves 0.95 / 0.90 of its layers' updates unexplained; STT 0.90 / 0.50 (+ jitter), so STT
        # predicts better, although its layer 1 has massive updates that make its raw mean MSE 50 times SDT's.
        write("sdt_50", "sdt", seed, lm_end=5.0 + 0.1 * seed + jitter, surprise={1: (10.0, 9.5), 3: (1.0, 0.9)},
              shift=0.3 + jitter, agreement=0.70 + jitter, loss=5.4 + 0.1 * seed)
        # STT ends 0.3 above MoD (a real contrary effect), predicts better than SDT, shifts towards CU, agrees more
        write("stt_50", "stt", seed, lm_end=5.3 + 0.1 * seed + jitter,
              surprise={1: (1000.0, 900.0), 3: (1.0, 0.5 + jitter)}, shift=-0.3 + jitter,
              agreement=0.80 + 2 * jitter, loss=5.3 + 0.1 * seed + jitter)
        # dynamic capacity falls with depth on every seed; its training loss rises on seed 2 while its teacher sheds
        # compute (not Fig. 2A's claim: no verdict)
        write("stt_dynamic", "stt", seed, lm_end=5.0 if seed < 2 else 9.0,
              fractions={1: 0.8 + jitter, 3: 0.6, 5: 0.4 - jitter}, loss=3.9 + 0.1 * seed, executed_end=0.6)
    write("sdt_50_prior0_25", "sdt", 0, surprise={1: (10.0, 3.0), 3: (1.0, 0.3)}, loss=5.4)
    rows = {}
    for line in claims.claims_table(tmp_path).splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        rows[(cells[1].split(" · ")[0], cells[2])] = (cells[3], cells[4])
    assert rows[("1", "mod_50")][1] == "reproduced"
    assert rows[("1", "stt_dynamic")] == (
        "training LM loss first 5 → last 15 steps: 6.71 → 5.00, 6.71 → 5.00, 7.29 → 9.00; teacher's executed "
        "fraction: 1.00 → 0.60, 1.00 → 0.60, 1.00 → 0.60", "no verdict: its compute falls while it trains")
    assert rows[("2", "sdt_50 − mod_50")][1] == "reproduced (no contrary effect beyond 2 se)"
    assert rows[("2", "stt_50 − mod_50")] == ("+0.305 ± 0.009 se (n = 3)", "not reproduced")
    # (0.90 + 0.50 + jitter) / 2 − (0.95 + 0.90) / 2 = −0.225 + jitter / 2: mean −0.2225 (prints −0.223), se 0.0044
    assert rows[("3", "stt_50 − sdt_50")] == ("-0.223 ± 0.004 se (n = 3)", "reproduced")
    assert rows[("3", "stt_50 − sdt_50_prior0_25")][1] == "inconclusive (1/3 seeds)"
    assert rows[("4", "stt_dynamic")][1] == "reproduced"
    assert rows[("5", "sdt_50")][1] == "reproduced" and rows[("5", "stt_50")][1] == "not reproduced"
    assert rows[("6", "stt_50 − sdt_50 (held-out accuracy)")][1] == "answered: STT's causal router agrees more"
    assert rows[("7", "sdt_50_prior0_25 − sdt_50")][1] == "inconclusive (1/3 seeds)"
    assert rows[("8", "lora_stt_50 − stt_50")] == ("not run yet: lora_stt_50", "inconclusive (0/3 seeds)")
    assert rows[("9", "mod_50 − dense")] == ("+1.500 ± 0.000 se (n = 3)", "reproduced")
    # stt_dynamic beats dense by 0.1 on every seed: the contrary effect, beyond 2 se
    assert rows[("9", "stt_dynamic − dense")][1] == "not reproduced"

    # A fixed-capacity variant whose training loss ends above its start on one seed does not train stably.
    diverging = tmp_path / "diverging"
    (diverging / "runs").mkdir(parents=True)
    for seed in range(3):
        write("sdt_50", "sdt", seed, lm_end=9.0 if seed == 1 else 5.0, out=diverging)
    (sdt_row,) = [line for line in claims.claims_table(diverging).splitlines()
                  if line.startswith("| 1 · Fig. 2A: trains stably | sdt_50 |")]
    assert "7.29 → 9.00" in sdt_row and sdt_row.endswith("| not reproduced |")


def test_predictor_curve_is_the_mean_per_layer_share_not_the_mean_mse():
    # Fig. 2B's panel: a layer with a massive update (D_st 1000) must not decide the curve. Per step, layer 1
    # leaves 0.9 of its update unexplained and layer 3 goes from 0.8 to 0.2; the mean of the shares is plotted.
    steps = [1, 2]
    series = {"routing/layer_1/d_ch": [900.0, 900.0], "routing/layer_1/d_st": [1000.0, 1000.0],
              "routing/layer_3/d_ch": [0.8, 0.2], "routing/layer_3/d_st": [1.0, 1.0],
              "routing/layer_5/d_ch": [None, 0.5], "routing/layer_5/d_st": [1.0, 0.0]}  # no value / no update
    result = {"curves": {"steps": steps, "series": series}}
    got_steps, shares = layer_mean_curve([result], "d_ch", divided_by="d_st")
    assert got_steps == steps
    assert shares == pytest.approx([0.85, 0.55])
    # the raw mean of D_ch would be decided by layer 1 alone
    _, raw = layer_mean_curve([result], "d_ch")
    assert raw[0] == pytest.approx(450.4)


def test_runs_from_takes_another_studys_definitions_by_name_and_rejects_unknown_names(tmp_path):
    """A study at another budget (experiments/budget_h100) trains the frontier's runs exactly, not a drifting copy."""
    first = {"name": "a", "out_dir": "a", "work_dir": "wa", "seeds": [0], "heldout": {"file": "h.jsonl"},
             "runs": [{"name": "dense", "config": "d.yaml"},
                      {"name": "stt", "config": "s.yaml", "overrides": {"model.capacity": 0.75}}]}
    (tmp_path / "first.yaml").write_text(json.dumps(first))
    second = {"name": "b", "out_dir": "b", "work_dir": "wb", "seeds": [0, 1], "heldout": {"file": "h.jsonl"},
              "budget": {"max_steps_per_epoch": 200}, "baselines": ["dense"],
              "runs_from": {"study": "first.yaml", "names": ["stt", "dense"]},
              "runs": [{"name": "mod", "config": "m.yaml"}]}
    path = tmp_path / "second.yaml"
    path.write_text(json.dumps(second))
    runs = load_study(path, root=tmp_path)["runs"]
    assert [run["name"] for run in runs] == ["stt", "dense", "mod"]
    assert runs[0]["overrides"] == {"model.capacity": 0.75}
    assert runs[0]["config"] == str(tmp_path / "s.yaml")
    path.write_text(json.dumps({**second, "runs_from": {"study": "first.yaml", "names": ["stt", "sdt"]}}))
    with pytest.raises(StudyError, match=r"runs_from names \['sdt'\] are not runs of first.yaml"):
        load_study(path, root=tmp_path)
    path.write_text(json.dumps({**second, "runs_from": {"study": "first.yaml"}}))
    with pytest.raises(StudyError, match="runs_from needs exactly"):
        load_study(path, root=tmp_path)
    # the committed GPU-budget studies: the frontier's definitions, only the budget differs
    frontier = {run["name"]: run for run in load_study(REPO / "experiments" / "frontier" / "study.yaml", root=REPO)["runs"]}
    for name in ("budget_h100/study.yaml", "budget_h100/anchor60.yaml", "budget_cpu200/study.yaml"):
        spec = load_study(REPO / "experiments" / name, root=REPO)
        # a run of the frontier's name is the frontier's run; others are the study's own (its `runs:` list, whose
        # names its parts may generate), runs that only exist at that budget
        taken = set(yaml.safe_load((REPO / "experiments" / name).read_text())["runs_from"]["names"])
        own = {run["name"] for run in spec["runs"]} - taken
        assert own.isdisjoint(frontier), f"{name} redefines frontier runs {sorted(own & set(frontier))}"
        assert spec["runs"] and all(run == frontier[run["name"]] for run in spec["runs"] if run["name"] not in own)
        assert {run["name"] for run in spec["runs"]} - own <= set(frontier)


def test_frontier_queue_lists_every_run_and_seed_of_the_study_and_nothing_else():
    """queue.sh runs exactly the pairs of queue.txt: a typo there would silently never run (or never finish)."""
    study = load_study(REPO / "experiments" / "frontier" / "study.yaml", root=REPO)
    defined = {f"{run['name']}:{seed}" for run in study["runs"] for seed in study["seeds"]}
    text = (REPO / "experiments" / "frontier" / "queue.txt").read_text()
    listed = [item for line in text.splitlines() for item in line.split("#")[0].split()]
    assert set(listed) - defined == set(), "queue.txt names runs or seeds the study does not define"
    assert defined - set(listed) == set(), "study.yaml defines runs queue.txt never runs"


def test_eleuther_config_of_a_run_older_than_a_required_key_evaluates_as_it_trained(tmp_path):
    """A layer-dropping run saved its config before ``skip_update`` was required: the stock eleuther_eval config the
    driver writes for it names ``skip_update: none`` (it would not build otherwise); a newer run's value is kept."""
    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[1]
    saved = OmegaConf.load(root / "configs" / "quickstart" / "layerdrop_smollm2.yaml")
    spec = {"eleuther": {"config": str(root / "configs" / "quickstart" / "eval_stt_smollm2.yaml"),
                         "include_path": "tasks"}, "_root": str(root)}
    for written, expected in ((None, "none"), ("bias", "bias")):
        if written is None:
            saved.model.pop("skip_update")
        else:
            saved.model.skip_update = written
        OmegaConf.save(saved, tmp_path / "torchtune_config.yaml")
        cfg = eleuther_config(spec, tmp_path / "torchtune_config.yaml", tmp_path, tmp_path / "eval")
        assert cfg["model"]["skip_update"] == expected and cfg["model"]["variant"] == "layerdrop"
