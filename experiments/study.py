"""Experiment driver: train, evaluate and aggregate a named study of routed-model runs (issue 14).

    python experiments/study.py run STUDY.yaml [--only NAME ...] [--seeds 0 1 2] [--no-aggregate] [--dry-run]
    python experiments/study.py aggregate OUT_DIR

Run it from the repository root: every relative path below (in the study file and in the configs it names) is
relative to the working directory, which is also where the training and held-out evaluation run.

Study file (YAML)
-----------------
::

    name: frontier_135m
    out_dir: experiments/frontier_135m                 # results: <out_dir>/runs/<run>__seed<k>.json, README.md, *.png
    work_dir: quickstart_work/studies/frontier_135m    # checkpoints, logs, eval configs (git-ignored)
    seeds: [0, 1, 2]
    budget: {max_steps_per_epoch: 100, batch_size: 4}  # config overrides applied to every run (same budget)
    validation_points: 4                               # optional (default 4): validation + checkpoint this often
    keep_checkpoints: true                             # optional (default true); false deletes a run's epoch_0
                                                       # once its JSON is written (135M: ~1.6 GB with the optimizer)
    heldout: {file: quickstart_work/corpus/heldout.jsonl, windows: 16, seq_len: 256, batch_size: 4}
    test: {file: quickstart_work/corpus/test.jsonl, windows: 64, seq_len: 256, spread: true}   # optional: scored
                                                       # once per finished run, never by a choice (see below)
    eleuther:                                          # or null to skip the stock eleuther_eval step
      config: configs/quickstart/eval_stt_smollm2.yaml # template: every eval key but model/tokenizer/checkpointer
      include_path: quickstart_work/corpus/lm_eval_tasks   # optional; default: the template's, relative to cwd
      cwd: .                                           # optional: where `tune run eleuther_eval` runs (task data paths)
      tasks: [heldout_next_sentence]                   # optional: default the template's
      limit: 100                                       # optional: default the template's
    baselines: [dense]                                 # run names every other run is paired against
    claims_runs: [stt_papers]                          # optional: the runs claims.png draws (default: every SDT/STT
                                                       # run; a study of many recipes names the papers' setting)
    runs:
      - name: dense
        config: configs/quickstart/dense_smollm2.yaml
        overrides: {}                                  # dotted key: value, passed to `tune run` as key=value
      - name: stt_papers
        config: configs/quickstart/stt_smollm2.yaml
        overrides: {model.gate: scaled, model.routed_layers: every_other}

A run's overrides may not touch a budget key (every run trains on the same budget). A study that repeats another's
runs at another budget or on another machine names them instead of copying them (``runs_from``; the list ``runs``,
if present, adds runs of its own after them)::

    runs_from: {study: experiments/frontier/study.yaml, names: [dense, layerdrop_4_distill_bias]}

What ``run`` does for each (run, seed) whose result JSON does not exist yet (finished runs are skipped, so a
study is resumable; delete a JSON to redo that run):

1. **Train** with the shipped recipe in a subprocess::

       tune run torchtune_dtf/recipes/routed_finetune.py --config CFG output_dir=<work_dir>/runs/<run>__seed<k>
           seed=<k> checkpointer.routing_init_seed=<k> <budget> save_every_n_steps=E validation.every_n_steps=E
           log_every_n_steps=1 <overrides>

   E is the smallest divisor of the step count that gives at most ``validation_points`` validation points (the
   last step always validates); ``budget`` may set ``save_every_n_steps``/``validation.every_n_steps``/
   ``log_every_n_steps`` itself. **Interrupted training resumes**: if the output folder holds a complete
   checkpoint of the run that owns it (``run.json``), the same command is rerun with
   ``resume_from_checkpoint=True`` (the recipe continues exactly or refuses with its reason); if the recipe
   refuses or fails on resume, or there is no checkpoint, the run restarts from scratch in a clean folder (a
   checkpoint at the run's last step, from a driver stopped right after training, is taken as it is). A
   finished training is marked by ``<output_dir>/study_train_done.json``. The training wall time is the sum of
   the attempts since the last fresh start, an attempt killed with the driver counting until its log's last
   write (attempts and their logs: ``<work_dir>/logs/<run>__seed<k>/``).
2. **Held-out evaluation** in this process, with ``torchtune_dtf.evaluation.routing_report`` (``heldout_windows``,
   ``load_trained``, ``heldout_loss``, ``layer_report``) on the config the recipe saved
   (``<output_dir>/torchtune_config.yaml``) and its final checkpoint ``epoch_0``: the student loss (the deployed
   causal routing; the dense model's default forward), the teacher loss at the β schedule's end values (routed
   variants only), and per routed layer the student's executed fraction and teacher–student agreement.
3. **MC accuracy** with torchtune's stock ``tune run eleuther_eval``, on a config written to
   ``<output_dir>/eleuther/eval_config.yaml``: the template's eval keys, the run's model and tokenizer (paths
   made absolute), and a ``RoutedHFCheckpointer`` on ``epoch_0``. It runs with ``HF_HOME=<work_dir>/hf_home``
   seeded with the offline ``gpt2`` stand-in (``torchtune_dtf.offline.lm_eval_standin``) and the hub switched off.
   With a ``test`` section, the student loss of every test window too (``spread``: windows evenly spaced over the
   whole file, so every work is read); the study's choices read the held-out (validation) file, the test file is
   read once, here, and ``aggregate`` pairs runs on it window by window.
4. **Compute**, closed form (``torchtune_dtf/closed_form.py``: ``per_token_compute``) at the held-out ``seq_len``
   with the measured executed fractions: forward FLOPs per token of the deployed (student) model and of the
   dense model of the same shape, their ratio, KV bytes per token and ratio, and a distillation teacher's
   FLOPs per training token apart.

Result JSON (``<out_dir>/runs/<run>__seed<k>.json``, written via a temporary file and a rename)
-------------------------------------------------------------------------------------------------
``schema`` ("study_run/1"), ``study``, ``name``, ``seed``, ``variant``, ``config_file``, ``overrides``,
``budget``, ``command`` (the training command), ``output_dir``, ``config`` (the resolved config the recipe
saved), ``steps`` (last logged step), ``planned_steps`` (epochs × max_steps_per_epoch; the data may give
fewer), ``train_tokens`` (sum of the recipe's ``tokens`` metric), ``train_attempts`` ([{mode: fresh|resume,
started, seconds, returncode, log, interrupted?}]), ``wall_time_s`` {train,
heldout_eval, eleuther, eval}, ``curves`` {steps: [...], series: {key: [value or null per step]}} (every key the
DiskLogger logged: ``loss/*``, ``val/lm_loss_student``, ``val/lm_loss_teacher``, ``routing/layer_i/*``, ``lr/*``,
…), ``heldout`` {file, windows, seq_len, tokens, student_loss, teacher_loss (null for dense), teacher_beta
{ce, cu}}, ``test`` (only with a test section: {file, windows, seq_len, placement, tokens, student_loss,
window_losses}), ``layers`` {layer: {student/selected_fraction, teacher/teacher_fraction, teacher/agreement_*, …}},
``executed_fraction`` {layer: student fraction}, ``executed_fraction_mean``, ``eleuther`` (null when skipped;
else {tasks, limit, results: {task: {metric: value, metric_stderr: value}}, mc_acc: mean ``acc`` over tasks}),
``compute`` (``per_token_compute``: seq_len, forward_flops_per_token, dense_forward_flops_per_token,
forward_flops_ratio, forward_flops_by_category_per_token, kv_bytes_per_token, dense_kv_bytes_per_token,
kv_bytes_ratio, bytes_per_value, executed_fraction_used, routed_layers, dropped_layers,
distillation_teacher_flops_per_token, …), ``routing_stats`` {layer_i: {metric: {mean, first, last}}} over the
training log, ``checkpoint_kept``, ``finished_at``.

``aggregate`` writes ``<out_dir>/README.md`` (tables: mean ± std over the seeds present, "partial" where a run
has fewer seeds than the study or none; paired differences run − baseline per seed with a t-interval) and the
PNG plots ``frontier.png``, ``curves.png``, ``validation.png``, ``executed_fraction.png``, and ``claims.png``
with a table for the papers' qualitative claims (predictor loss PriorFFN vs TPN, STT dynamic capacity per
layer, CE/CU shares of the teacher's choices over training, teacher–student agreement STT vs SDT).
"""

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's torchtune_dtf and benchmarks, whatever is installed

RECIPE = "torchtune_dtf/recipes/routed_finetune.py"
SCHEMA = "study_run/1"
DONE_MARKER = "study_train_done.json"
BUDGET_SCHEDULE_KEYS = ("save_every_n_steps", "validation.every_n_steps", "log_every_n_steps")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
PLOTS = ("frontier.png", "curves.png", "validation.png", "executed_fraction.png", "claims.png")
ROUTED_VARIANTS = ("mod", "sdt", "stt")


class StudyError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------ study file
def _runs_from(source: Any, root: Path, path: Path) -> List[Dict[str, Any]]:
    """``runs_from: {study: other.yaml, names: [...]}``: those runs of another study, definitions and all, so that
    a study at another budget trains exactly what the first one did (the copies cannot drift apart)."""
    if not isinstance(source, dict) or set(source) != {"study", "names"} or not source["names"]:
        raise StudyError(f"{path}: runs_from needs exactly {{study: PATH, names: [RUN, ...]}}, got {source!r}")
    other = root / source["study"]
    if not other.is_file():
        raise StudyError(f"{path}: runs_from study {str(other)!r} does not exist")
    defined = {run["name"]: run for run in load_study(other, root)["runs"]}  # validated as a study of its own
    unknown = [name for name in source["names"] if name not in defined]
    if unknown:
        raise StudyError(f"{path}: runs_from names {unknown} are not runs of {source['study']}")
    return [defined[name] for name in source["names"]]


def load_study(path: Path, root: Optional[Path] = None) -> Dict[str, Any]:
    """The study as a plain dict, paths made absolute against ``root`` (default: the working directory)."""
    from omegaconf import OmegaConf

    root = Path(root or Path.cwd()).resolve()
    study = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    required = ("name", "out_dir", "work_dir", "seeds") + (() if "runs_from" in study else ("runs",))
    problems = [f"missing key {key!r}" for key in required if key not in study]
    if problems:
        raise StudyError(f"{path}: " + "; ".join(problems))
    if "runs_from" in study:
        study["runs"] = _runs_from(study.pop("runs_from"), root, path) + list(study.get("runs") or [])
    study.setdefault("budget", {})
    study.setdefault("baselines", [])
    study.setdefault("claims_runs", None)
    study.setdefault("eleuther", None)
    study.setdefault("validation_points", 4)
    study.setdefault("keep_checkpoints", True)
    if "heldout" not in study or not study["heldout"]:
        raise StudyError(f"{path}: missing heldout: {{file, windows, seq_len}}")
    absolute = lambda p: str((root / p).resolve()) if p is not None else None  # noqa: E731
    study["out_dir"], study["work_dir"] = absolute(study["out_dir"]), absolute(study["work_dir"])
    study["heldout"] = {"batch_size": 4, **study["heldout"], "file": absolute(study["heldout"]["file"])}
    if study.get("test"):  # optional (a study without one writes the study.json it always wrote)
        test = dict(study["test"])
        missing = [key for key in ("file", "windows", "seq_len", "spread") if key not in test]
        if missing:
            raise StudyError(f"{path}: test needs {{file, windows, seq_len, spread}}; missing {missing}")
        if Path(absolute(test["file"])) == Path(study["heldout"]["file"]):
            raise StudyError(f"{path}: test file {test['file']!r} is the held-out (validation) file; a test set must "
                             "be text no choice has looked at")
        study["test"] = {"batch_size": 4, **test, "file": absolute(test["file"])}
    if study["eleuther"]:
        el = dict(study["eleuther"])
        el["config"] = absolute(el["config"])
        el["cwd"] = absolute(el.get("cwd") or ".")
        if el.get("include_path") is not None:
            el["include_path"] = absolute(el["include_path"])
        study["eleuther"] = el
    names = [run.get("name") for run in study["runs"]]
    if any(not isinstance(n, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", n) for n in names):
        problems.append(f"every run needs a name of letters, digits, '_', '.', '-': {names}")
    if len(set(names)) != len(names):
        problems.append(f"run names repeat: {names}")
    for run in study["runs"]:
        run.setdefault("overrides", {})
        run["overrides"] = dict(run["overrides"] or {})
        if "config" not in run:
            problems.append(f"run {run.get('name')!r} has no config")
            continue
        run["config"] = absolute(run["config"])
        clash = sorted(set(run["overrides"]) & set(study["budget"]))
        if clash:
            problems.append(f"run {run['name']!r} overrides budget key(s) {clash}: every run has the same budget")
    unknown = sorted(set(study["baselines"]) - set(names))
    if unknown:
        problems.append(f"baselines {unknown} are not run names")
    unknown = sorted(set(study["claims_runs"] or []) - set(names))
    if unknown:
        problems.append(f"claims_runs {unknown} are not run names")
    if problems:
        raise StudyError(f"{path}: " + "; ".join(problems))
    study["_root"] = str(root)
    study["_source"] = str(Path(path).resolve())
    return study


def cli_value(value: Any) -> str:
    """A config value as `tune run` parses key=value (YAML): strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def run_id(name: str, seed: int) -> str:
    return f"{name}__seed{seed}"


def schedule_every(steps: Optional[int], points: int) -> Optional[int]:
    """The smallest divisor of ``steps`` giving at most ``points`` multiples up to ``steps`` (the last step is one)."""
    if not steps or steps <= 0:
        return None
    for d in range(1, steps + 1):
        if steps % d == 0 and steps // d <= max(points, 1):
            return d
    return steps


def planned_steps(config_file: str, budget: Dict[str, Any], overrides: Dict[str, Any]) -> Optional[int]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config_file)
    for key, value in {**overrides, **budget}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    steps, epochs = cfg.get("max_steps_per_epoch"), cfg.get("epochs", 1)
    return int(steps) * int(epochs) if isinstance(steps, int) and isinstance(epochs, int) else None


def train_command(study: Dict[str, Any], run: Dict[str, Any], seed: int, output_dir: Path,
                  resume: bool = False) -> List[str]:
    tune = Path(sys.executable).with_name("tune")
    command = [str(tune)] if tune.is_file() else [sys.executable, "-m", "torchtune._cli.tune"]
    args = train_overrides(study, run, seed, output_dir)
    if resume:
        args["resume_from_checkpoint"] = True
    return [*command, "run", RECIPE, "--config", run["config"], *(f"{k}={cli_value(v)}" for k, v in args.items())]


def train_overrides(study: Dict[str, Any], run: Dict[str, Any], seed: int, output_dir: Path) -> Dict[str, Any]:
    """The ``key: value`` overrides a run's training command applies to its config file."""
    budget = dict(study["budget"])
    steps = planned_steps(run["config"], budget, run["overrides"])
    every = schedule_every(steps, int(study["validation_points"]))
    schedule = {"log_every_n_steps": 1}
    if every:
        schedule.update({"save_every_n_steps": every, "validation.every_n_steps": every})
    args = {"output_dir": str(output_dir), "seed": seed, "checkpointer.routing_init_seed": seed}
    args.update(budget)
    args.update({k: v for k, v in schedule.items() if k not in budget})
    args.update(run["overrides"])
    return args


#: Config entries whose change makes a finished run's result stale (what it trained and how it was evaluated).
COMPARED_KEYS = ("model", "dataset", "seed", "batch_size", "epochs", "max_steps_per_epoch", "gradient_accumulation_steps",
                 "optimizer", "learning_rates", "lr_scheduler", "loss", "freeze_base", "dtype", "routing_loss_weights",
                 "beta_schedule", "scheduled_sampling", "capacity_curriculum", "student_calibration", "distillation")


#: Keys added to the configs after some runs finished: absent from a result, they are unchanged if now off.
OFF_WHEN = {
    "student_calibration": lambda v: v.get("batches") == 0,
    "capacity_curriculum": lambda v: v.get("ramp_steps") == 0,
    "distillation": lambda v: v.get("weight") == 0,
}
def _model_as_recorded(planned: Dict[str, Any], recorded: Dict[str, Any]) -> Dict[str, Any]:
    """``planned``'s model section without the later-added keys that ``recorded`` lacks and that are off: the
    recipe's own table of them (``ADDED_FINGERPRINT_ENTRIES``), by which an older checkpoint still resumes."""
    from torchtune_dtf.recipes.routed_finetune import ADDED_FINGERPRINT_ENTRIES

    off = {key.removeprefix("model."): value for key, value in ADDED_FINGERPRINT_ENTRIES.items()
           if key.startswith("model.")}
    return {key: value for key, value in planned.items() if key in recorded or key not in off or value != off[key]}


def planned_config(study: Dict[str, Any], run: Dict[str, Any], seed: int, output_dir: Path) -> Dict[str, Any]:
    """The resolved training config ``train_command`` would run (its ``key=value`` arguments applied)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run["config"])
    for key, value in train_overrides(study, run, seed, output_dir).items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return OmegaConf.to_container(cfg, resolve=True)


def stale_keys(study: Dict[str, Any], run: Dict[str, Any], result: Dict[str, Any]) -> List[str]:
    """Config entries in which the study's current definition of ``run`` differs from what ``result`` trained
    (empty: the result is current). A study file or shipped config edited after a run finished otherwise leaves
    its old numbers in the tables without a word."""
    planned = planned_config(study, run, int(result["seed"]), Path(result["output_dir"]))
    recorded = result.get("config") or {}
    if isinstance(planned.get("model"), dict) and isinstance(recorded.get("model"), dict):
        planned["model"] = _model_as_recorded(planned["model"], recorded["model"])
    return [key for key in COMPARED_KEYS if planned.get(key) != recorded.get(key)
            and not (key not in recorded and key in OFF_WHEN and OFF_WHEN[key](planned.get(key) or {}))]


def subprocess_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------------------ training
def training_state(output_dir: Path) -> str:
    """``done`` (marker written), ``finished`` (the run's last checkpoint is its final one, the marker is
    missing: the driver stopped right after training), ``resume`` (a complete checkpoint of the run that owns
    the folder, mid-run) or ``fresh``."""
    if (output_dir / DONE_MARKER).is_file() and (output_dir / "epoch_0").is_dir():
        return "done"  # (a run whose checkpoint was deleted after its JSON trains again if its JSON is deleted)
    if not output_dir.is_dir():
        return "fresh"
    import torch

    from torchtune_dtf.training.checkpointer import (RECIPE_STATE_FNAME, RUN_ID_KEY, STEP_KEY, checkpoint_folders,
                                                     read_manifest, read_run_id)

    try:
        owner = read_run_id(output_dir)
        folders = checkpoint_folders(output_dir)
        if owner is None or not folders:
            return "fresh"
        folder = folders[max(folders)]
        manifest = read_manifest(folder)
        if not manifest or manifest.get(RUN_ID_KEY) != owner:
            return "fresh"
        # The recipe state knows the planned length; mmap reads it without loading the optimizer state.
        state = torch.load(folder / RECIPE_STATE_FNAME, mmap=True, weights_only=False, map_location="cpu")
        if int(state[STEP_KEY]) >= int(state["total_steps"]):
            return "finished"
    except (OSError, ValueError, KeyError, RuntimeError):
        return "fresh"
    return "resume"


def _attempts_file(logs_dir: Path) -> Path:
    return logs_dir / "attempts.json"


def _read_attempts(logs_dir: Path) -> List[Dict[str, Any]]:
    path = _attempts_file(logs_dir)
    return json.loads(path.read_text()) if path.is_file() else []


def _write_json(path: Path, data: Any, text: Optional[str] = None) -> None:
    """Atomic write with a temporary name of its own: workers of one study started side by side each write the
    same ``study.json``, and with one shared temporary name the second rename found it gone."""
    from torchtune_dtf.atomic_write import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text if text is not None else json.dumps(data, indent=1))


def _run_logged(command: List[str], log_file: Path, cwd: Path, env: Dict[str, str]) -> Tuple[int, float]:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_file, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        proc = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc.returncode, time.perf_counter() - start


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _settle_attempts(attempts: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Attempts the driver did not see finish (killed with it) get their duration from their log's last write."""
    for attempt in attempts:
        if attempt.get("seconds") is None:
            log = Path(attempt["log"])
            attempt["seconds"] = max(0.0, log.stat().st_mtime - attempt["started"]) if log.is_file() else 0.0
            attempt["interrupted"] = True
    return attempts


def train(study: Dict[str, Any], run: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """Train (or resume, or restart) one run until its marker exists; return the marker's content."""
    rid = run_id(run["name"], seed)
    work = Path(study["work_dir"])
    output_dir, logs_dir = work / "runs" / rid, work / "logs" / rid
    root = Path(study["_root"])
    state = training_state(output_dir)
    attempts = _settle_attempts(_read_attempts(logs_dir))
    if state in ("resume", "fresh"):
        modes = ["resume", "fresh"] if state == "resume" else ["fresh"]
        for mode in modes:
            if mode == "fresh":
                shutil.rmtree(output_dir, ignore_errors=True)
                attempts = []  # the training time counts from the last fresh start
            command = train_command(study, run, seed, output_dir, resume=mode == "resume")
            log_file = logs_dir / f"train_{len(list(logs_dir.glob('train_*.log'))) + 1:02d}_{mode}.log"
            attempt = {"mode": mode, "started": time.time(), "seconds": None, "returncode": None, "log": str(log_file)}
            attempts.append(attempt)
            _write_json(_attempts_file(logs_dir), attempts)
            print(f"== {rid}: training ({mode}); log {log_file}", flush=True)
            attempt["returncode"], attempt["seconds"] = _run_logged(command, log_file, root, subprocess_env())
            _write_json(_attempts_file(logs_dir), attempts)
            if attempt["returncode"] == 0:
                state = "finished"
                break
            print(f"== {rid}: training ({mode}) exited {attempt['returncode']}:\n{_tail(log_file)}", flush=True)
        else:
            raise StudyError(f"{rid}: training failed (see {logs_dir})")
    if state == "finished":
        command = train_command(study, run, seed, output_dir)
        marker = {"train_seconds": sum(a["seconds"] for a in attempts), "attempts": attempts, "command": command}
        _write_json(output_dir / DONE_MARKER, marker)
    return json.loads((output_dir / DONE_MARKER).read_text())


# ------------------------------------------------------------------------------------------ training log
# (the DiskLogger files are read by torchtune_dtf.evaluation.metric_logs.parse_disk_logs, shared with routing_plots)
def _round(value: float, digits: int = 6) -> Optional[float]:
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{digits}g}")


def curves_from_log(rows: Dict[int, Dict[str, float]]) -> Dict[str, Any]:
    steps = sorted(rows)
    keys = sorted({k for row in rows.values() for k in row})
    return {"steps": steps, "series": {k: [_round(rows[s][k]) if k in rows[s] else None for s in steps] for k in keys}}


def routing_stats(rows: Dict[int, Dict[str, float]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Per routed layer and logged routing metric: mean over the training steps, first and last value."""
    series: Dict[str, Dict[str, List[float]]] = {}
    for step in sorted(rows):
        for key, value in rows[step].items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "routing" and math.isfinite(value):
                series.setdefault(parts[1], {}).setdefault(parts[2], []).append(value)
    return {
        layer: {name: {"mean": statistics.fmean(v), "first": v[0], "last": v[-1]} for name, v in sorted(metrics.items())}
        for layer, metrics in sorted(series.items(), key=lambda kv: int(kv[0].split("_")[-1]))
    }


# ------------------------------------------------------------------------------------------ evaluation
def heldout_evaluation(saved_config: Path, checkpoint_dir: Path, heldout: Dict[str, Any],
                       test: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Student and teacher held-out loss and per-layer routing report of a trained run (in this process); with
    ``test``, also the deployed (student) loss of each test window (the test set is scored once, at the end, and
    runs are compared on it window by window) and the seconds that took (``test_seconds``)."""
    import torch
    from omegaconf import OmegaConf
    from torchtune import config

    from torchtune_dtf.modules import RoutedSelfAttentionLayer, RoutingContext
    from torchtune_dtf.evaluation.routing_report import heldout_loss, heldout_windows, layer_report, load_trained
    from torchtune_dtf.evaluation.side_by_side import window_losses

    cfg = OmegaConf.load(saved_config)
    tokenizer = config.instantiate(cfg.tokenizer)
    windows = heldout_windows(tokenizer, Path(heldout["file"]), int(heldout["seq_len"]), int(heldout["windows"]))
    model = load_trained(cfg, checkpoint_dir)
    batch_size = int(heldout.get("batch_size", 4))
    routed = any(isinstance(m, RoutedSelfAttentionLayer) for m in model.modules())
    beta = cfg.get("beta_schedule")
    beta_ce = float(beta.beta_ce_end) if beta is not None else None
    beta_cu = float(beta.beta_cu_end) if beta is not None else None
    out: Dict[str, Any] = {
        "file": heldout["file"], "windows": int(heldout["windows"]), "seq_len": int(heldout["seq_len"]),
        "tokens": int(windows[:, 1:].numel()),
        "student_loss": heldout_loss(model, windows, RoutingContext(mode="student") if routed else None, batch_size),
        "teacher_loss": None, "teacher_beta": None,
    }
    layers: Dict[int, Dict[str, float]] = {}
    if routed:
        teacher = RoutingContext(mode="teacher", beta_ce=beta_ce, beta_cu=beta_cu)
        out["teacher_loss"] = heldout_loss(model, windows, teacher, batch_size)
        out["teacher_beta"] = {"ce": beta_ce, "cu": beta_cu}
        layers = layer_report(model, windows, beta_ce, beta_cu, batch_size)
    result = {"heldout": out, "layers": {str(k): v for k, v in layers.items()}}
    if test:
        start = time.perf_counter()
        test_windows = heldout_windows(tokenizer, Path(test["file"]), int(test["seq_len"]), int(test["windows"]),
                                       spread=bool(test["spread"]))
        losses = window_losses(model, test_windows, (lambda: RoutingContext(mode="student")) if routed else None,
                               int(test.get("batch_size", 4)))
        result["test"] = {"file": test["file"], "windows": int(test["windows"]), "seq_len": int(test["seq_len"]),
                          "placement": "spread" if test["spread"] else "first",
                          "tokens": int(test_windows[:, 1:].numel()), "student_loss": float(losses.mean()),
                          "window_losses": [round(float(v), 6) for v in losses]}
        result["test_seconds"] = time.perf_counter() - start
    del model
    return result


def _absolutize_paths(section: Dict[str, Any], root: Path) -> Dict[str, Any]:
    out = {}
    for key, value in section.items():
        if isinstance(value, str) and key != "_component_" and not Path(value).is_absolute() and (root / value).exists():
            value = str((root / value).resolve())
        out[key] = value
    return out


def eleuther_config(study: Dict[str, Any], saved_config: Path, checkpoint_dir: Path, eval_dir: Path) -> Dict[str, Any]:
    """The stock eleuther_eval config of a trained run: the template's eval keys, the run's model and
    tokenizer, and our checkpointer on its final checkpoint."""
    from omegaconf import OmegaConf

    from torchtune_dtf.models.qwen2_5 import merged_model_config
    from torchtune_dtf.models.routing_config import with_keys_added_later

    el = study["eleuther"]
    root = Path(study["_root"])
    template = OmegaConf.to_container(OmegaConf.load(el["config"]), resolve=False)
    saved = OmegaConf.to_container(OmegaConf.load(saved_config), resolve=True)
    cfg = dict(template)
    cfg["output_dir"] = str(eval_dir)
    # a LoRA run's checkpoint holds LoRA merged into the base; a run older than a required key evaluates as it trained
    cfg["model"] = with_keys_added_later(merged_model_config(saved["model"]))
    tokenizer = _absolutize_paths(saved["tokenizer"], root)
    if "tokenizer" in template and "max_seq_len" in template["tokenizer"]:
        tokenizer["max_seq_len"] = template["tokenizer"]["max_seq_len"]
    cfg["tokenizer"] = tokenizer
    ckpt = {k: v for k, v in saved["checkpointer"].items() if k not in ("model", "output_dir", "checkpoint_dir",
                                                                          "checkpoint_files")}
    ckpt.update(checkpoint_dir=str(checkpoint_dir),
                checkpoint_files=sorted(p.name for p in checkpoint_dir.glob("model-*.safetensors")),
                output_dir="${output_dir}", model="${model}")
    cfg["checkpointer"] = ckpt
    if el.get("include_path") is not None:
        cfg["include_path"] = el["include_path"]
    elif cfg.get("include_path"):
        cfg["include_path"] = str((Path(el["cwd"]) / cfg["include_path"]).resolve())
    for key in ("tasks", "limit", "batch_size", "max_seq_length"):
        if key in el:
            cfg[key] = el[key]
    cfg.setdefault("device", saved.get("device", "cpu"))
    cfg.setdefault("dtype", saved.get("dtype", "fp32"))
    return cfg


def parse_eleuther_table(text: str) -> Dict[str, Dict[str, float]]:
    """``{task: {metric: value, metric_stderr: value}}`` from lm-eval's markdown results table."""
    results: Dict[str, Dict[str, float]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 7 or cells[4] in ("Metric", ""):
            continue
        if cells[0]:
            current = cells[0].lstrip("- ").strip()
        if current is None:
            continue
        try:
            value = float(cells[6])
        except ValueError:
            continue
        results.setdefault(current, {})[cells[4]] = value
        if len(cells) > 8:
            try:
                results[current][f"{cells[4]}_stderr"] = float(cells[8])
            except ValueError:
                pass
    return results


def seed_offline_hf_home(hf_home: Path, log_file: Path) -> None:
    """The `gpt2` stand-in the stock eval wrapper asks for, in a study-private HF cache (once per study)."""
    if (hf_home / "hub" / "models--gpt2" / "refs" / "main").is_file():
        return
    command = [sys.executable, "-m", "torchtune_dtf.offline.lm_eval_standin", "--hf-home", str(hf_home)]
    returncode, _ = _run_logged(command, log_file, REPO, subprocess_env())
    if returncode != 0:
        raise StudyError(f"writing the offline gpt2 stand-in failed; see {log_file}:\n{_tail(log_file)}")


def run_eleuther(study: Dict[str, Any], rid: str, saved_config: Path, checkpoint_dir: Path) -> Tuple[Dict[str, Any], float]:
    from omegaconf import OmegaConf

    work = Path(study["work_dir"])
    eval_dir = work / "runs" / rid / "eleuther"
    eval_dir.mkdir(parents=True, exist_ok=True)
    cfg = eleuther_config(study, saved_config, checkpoint_dir, eval_dir)
    config_path = eval_dir / "eval_config.yaml"
    OmegaConf.save(OmegaConf.create(cfg), config_path)
    hf_home = work / "hf_home"
    seed_offline_hf_home(hf_home, work / "logs" / "hf_home.log")
    tune = Path(sys.executable).with_name("tune")
    command = [str(tune)] if tune.is_file() else [sys.executable, "-m", "torchtune._cli.tune"]
    command += ["run", "eleuther_eval", "--config", str(config_path)]
    log_file = work / "logs" / rid / "eleuther.log"
    print(f"== {rid}: eleuther_eval; log {log_file}", flush=True)
    env = subprocess_env({"HF_HOME": str(hf_home), "HF_DATASETS_CACHE": str(hf_home / "datasets")})
    returncode, seconds = _run_logged(command, log_file, Path(study["eleuther"]["cwd"]), env)
    text = log_file.read_text(errors="replace")
    if returncode != 0 or "Eval completed" not in text:
        raise StudyError(f"{rid}: eleuther_eval failed (exit {returncode}); see {log_file}:\n{_tail(log_file)}")
    results = parse_eleuther_table(text)
    accs = [metrics["acc"] for metrics in results.values() if "acc" in metrics]
    return {
        "config": str(config_path),
        "tasks": list(cfg["tasks"]),
        "limit": cfg.get("limit"),
        "results": results,
        "mc_acc": statistics.fmean(accs) if accs else None,
    }, seconds


def compute_summary(saved: Dict[str, Any], executed: Dict[int, float], seq_len: int) -> Dict[str, Any]:
    from torchtune_dtf import closed_form as cf

    model = saved["model"]
    shape = cf.model_shape_from_config(model)
    rshape = cf.routing_shape_from_model_config(model, shape.num_layers, shape.embed_dim)
    dtype = str(saved.get("dtype", "fp32"))
    bytes_per_value = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype, 4)
    distillation = saved.get("distillation") or {}
    weight = float(distillation.get("weight", 0.0) or 0.0)
    train_seq_len = (saved.get("tokenizer") or {}).get("max_seq_len")
    out = cf.per_token_compute(shape, rshape, seq_len, executed, bytes_per_value=bytes_per_value,
                               distillation_weight=weight, distillation_seq_len=train_seq_len or seq_len)
    out["variant"] = rshape.variant
    out["distillation_weight"] = weight
    return out


# ------------------------------------------------------------------------------------------ one run
def dumps_result(result: Dict[str, Any]) -> str:
    """JSON with one line per curve series (readable, and diffs stay small)."""
    lines = []
    for key, value in result.items():
        if key == "curves":
            series = ",\n".join(f"   {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                for k, v in value["series"].items())
            body = (f'{{\n  "steps": {json.dumps(value["steps"], separators=(",", ":"))},\n'
                    f'  "series": {{\n{series}\n  }}\n }}')
            lines.append(f" {json.dumps(key)}: {body}")
        elif key == "test":  # the per-window losses on one line
            fields = [f'  {json.dumps(k)}: {json.dumps(v, separators=(",", ":"))}' for k, v in value.items()]
            lines.append(f" {json.dumps(key)}: {{\n" + ",\n".join(fields) + "\n }")
        else:
            lines.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    return "{\n" + ",\n".join(lines) + "\n}\n"


def run_one(study: Dict[str, Any], run: Dict[str, Any], seed: int) -> Path:
    from omegaconf import OmegaConf

    from torchtune_dtf.evaluation.metric_logs import parse_disk_logs

    rid = run_id(run["name"], seed)
    result_path = Path(study["out_dir"]) / "runs" / f"{rid}.json"
    marker = train(study, run, seed)
    output_dir = Path(study["work_dir"]) / "runs" / rid
    saved_config = output_dir / "torchtune_config.yaml"
    checkpoint_dir = output_dir / "epoch_0"
    saved = OmegaConf.to_container(OmegaConf.load(saved_config), resolve=True)

    print(f"== {rid}: held-out evaluation" + (" and test windows" if study.get("test") else ""), flush=True)
    start = time.perf_counter()
    evaluation = heldout_evaluation(saved_config, checkpoint_dir, study["heldout"], study.get("test"))
    test, test_seconds = evaluation.get("test"), evaluation.get("test_seconds")
    heldout_seconds = time.perf_counter() - start - (test_seconds or 0.0)
    eleuther, eleuther_seconds = None, 0.0
    if study.get("eleuther"):
        eleuther, eleuther_seconds = run_eleuther(study, rid, saved_config, checkpoint_dir)

    rows = parse_disk_logs(output_dir / "logs")
    train_steps = [s for s, row in rows.items() if "loss/lm" in row]
    tokens = [row["tokens"] for row in rows.values() if "tokens" in row]
    executed = {int(layer): values["student/selected_fraction"] for layer, values in evaluation["layers"].items()
                if "student/selected_fraction" in values}
    compute = compute_summary(saved, executed, int(study["heldout"]["seq_len"]))
    result = {
        "schema": SCHEMA,
        "study": study["name"],
        "name": run["name"],
        "seed": seed,
        "variant": compute["variant"],
        "config_file": run["config"],
        "overrides": run["overrides"],
        "budget": study["budget"],
        "command": marker.get("command"),
        "output_dir": str(output_dir),
        "steps": max(train_steps) if train_steps else 0,
        "planned_steps": planned_steps(run["config"], study["budget"], run["overrides"]),
        "train_tokens": int(sum(tokens)) if tokens else None,
        "train_attempts": marker.get("attempts", []),
        "wall_time_s": {"train": marker["train_seconds"], "heldout_eval": heldout_seconds,
                        "eleuther": eleuther_seconds if eleuther else None,
                        "eval": heldout_seconds + eleuther_seconds,
                        **({"test_eval": test_seconds} if test is not None else {})},
        "heldout": evaluation["heldout"],
        **({"test": test} if test is not None else {}),
        "layers": evaluation["layers"],
        "executed_fraction": {str(k): v for k, v in sorted(executed.items())},
        "executed_fraction_mean": statistics.fmean(executed.values()) if executed else None,
        "eleuther": eleuther,
        "compute": compute,
        "routing_stats": routing_stats(rows),
        "checkpoint_kept": bool(study.get("keep_checkpoints", True)),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": saved,
        "curves": curves_from_log(rows),
    }
    _write_json(result_path, None, dumps_result(result))
    print(f"== {rid}: wrote {result_path}", flush=True)
    if not result["checkpoint_kept"]:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # the marker keeps the run from training again
    return result_path


def cmd_run(args: argparse.Namespace) -> int:
    study = load_study(Path(args.study))
    seeds = [int(s) for s in (args.seeds if args.seeds else study["seeds"])]
    names = [run["name"] for run in study["runs"]]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        raise StudyError(f"--only {unknown}: not runs of {args.study} ({names})")
    runs = [run for run in study["runs"] if not args.only or run["name"] in args.only]
    out_dir = Path(study["out_dir"])
    if not args.dry_run:
        spec = {k: v for k, v in study.items() if not k.startswith("_")}
        spec["source"] = study["_source"]
        _write_json(out_dir / "study.json", spec)  # what aggregate expects (runs, seeds, baselines)
    failures = []
    for run in runs:
        for seed in seeds:
            rid = run_id(run["name"], seed)
            result_path = out_dir / "runs" / f"{rid}.json"
            if result_path.is_file():
                stale = stale_keys(study, run, json.loads(result_path.read_text()))
                if not stale:
                    print(f"== {rid}: done, skipped", flush=True)
                    continue
                if not args.rerun_stale:
                    print(f"== {rid}: STALE: the study now defines {', '.join(stale)} differently from what this "
                          f"result trained; --rerun-stale retrains it (or delete {result_path})", flush=True)
                    failures.append(rid)
                    continue
                print(f"== {rid}: stale ({', '.join(stale)}): retraining", flush=True)
                if not args.dry_run:
                    result_path.unlink()
                    shutil.rmtree(Path(study["work_dir"]) / "runs" / rid, ignore_errors=True)
            if args.dry_run:
                output_dir = Path(study["work_dir"]) / "runs" / rid
                print(f"== {rid}: would train: " + " ".join(train_command(study, run, seed, output_dir)), flush=True)
                continue
            try:
                run_one(study, run, seed)
            except StudyError as err:
                print(f"== {rid}: FAILED: {err}", flush=True)
                failures.append(rid)
    if not args.no_aggregate and not args.dry_run:
        aggregate(out_dir)
    if failures:
        print(f"== failed: {', '.join(failures)}", flush=True)
        return 1
    return 0


# ------------------------------------------------------------------------------------------ aggregate
#: Two-sided 95 % quantiles of Student's t, t_{0.975, dof}, dof = 1…30 (beyond: 1.96 is within 2 %).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(dof: int) -> float:
    return T975[dof - 1] if 1 <= dof <= len(T975) else 1.96


def paired_difference(diffs: Sequence[float]) -> Dict[str, Any]:
    """Mean, standard deviation, standard error and 95 % t-interval (n − 1 dof) of per-seed differences."""
    n = len(diffs)
    mean = statistics.fmean(diffs) if n else None
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "se": None, "ci95": None}
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = t975(n - 1) * se
    return {"n": n, "mean": mean, "sd": sd, "se": se, "ci95": (mean - half, mean + half)}


def seed_window_bootstrap(pairs: Sequence[Tuple[Sequence[float], Sequence[float]]], *, resamples: int, seed: int,
                          level: float = 0.95) -> Dict[str, Any]:
    """Mean of run − baseline over seeds and test windows, with a percentile interval from a two-level bootstrap:
    each resample draws seeds with replacement (a run paired with its baseline of the same seed) and windows with
    replacement (the same windows for both, as every run reads the same test windows), so the interval covers text
    sampling as well as training noise. ``pairs``: per seed, (run's window losses, baseline's window losses)."""
    import numpy as np

    lengths = sorted({len(losses) for pair in pairs for losses in pair})
    if not pairs or len(lengths) != 1 or lengths[0] == 0:
        raise ValueError(f"pairs must hold per-window losses of one length for every seed, got lengths {lengths}")
    diffs = np.array([np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64) for a, b in pairs])
    rng = np.random.default_rng(seed)
    n_seeds, n_windows = diffs.shape
    seeds = rng.integers(0, n_seeds, size=(resamples, n_seeds))
    windows = rng.integers(0, n_windows, size=(resamples, n_windows))
    means = diffs[seeds[:, :, None], windows[:, None, :]].mean(axis=(1, 2))
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return {"n_seeds": n_seeds, "windows": n_windows, "mean": float(diffs.mean()), "interval": (float(lo), float(hi)),
            "resamples": resamples}


def test_section(order: List[str], runs: Dict[str, List[Dict[str, Any]]], baselines: List[str],
                 resamples: int = 2000) -> List[str]:
    """The test-set table (runs scored on the study's ``test`` windows), or nothing when no run was."""
    scored = {n: [r for r in runs.get(n, []) if r.get("test")] for n in order}
    scored = {n: rs for n, rs in scored.items() if rs}
    if not scored:
        return []
    first = next(iter(scored.values()))[0]["test"]
    lines = ["## Test set", "",
             f"Student loss per token on {first['windows']} windows × {first['seq_len']} tokens "
             f"({first['placement']} over `{Path(first['file']).name}`), works that no choice of this study looked at; "
             "each finished run is scored once. Δ = run − baseline, averaged over the seeds both have; 95 % interval "
             f"from {resamples} bootstrap resamples of seeds (paired by seed) and windows (paired by window).", ""]
    header = ["run", "seeds", "test loss"] + [f"Δ vs `{b}` | 95 % CI" for b in baselines]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * (3 + 2 * len(baselines)))
    for n, results in scored.items():
        cells = [f"`{n}`", str(len(results)), _fmt([r["test"]["student_loss"] for r in results], 3)]
        for base in baselines:
            base_by_seed = {r["seed"]: r["test"] for r in scored.get(base, [])}
            pairs = [(r["test"]["window_losses"], base_by_seed[r["seed"]]["window_losses"]) for r in results
                     if r["seed"] in base_by_seed and n != base]
            if not pairs:
                cells += ["–", "–"]
                continue
            boot = seed_window_bootstrap(pairs, resamples=resamples, seed=0)
            cells += [f"{boot['mean']:+.3f} (n {boot['n_seeds']})",
                      f"[{boot['interval'][0]:+.3f}, {boot['interval'][1]:+.3f}]"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


#: Table columns: (header, value of one run JSON, digits).
def _metric_fns():
    def get(*keys):
        def fn(r):
            value = r
            for key in keys:
                if not isinstance(value, dict) or value.get(key) is None:
                    return None
                value = value[key]
            return float(value)
        return fn

    return [
        ("fwd FLOPs ratio", get("compute", "forward_flops_ratio"), 3),
        ("KV bytes ratio", get("compute", "kv_bytes_ratio"), 3),
        ("student loss", get("heldout", "student_loss"), 3),
        ("teacher loss", get("heldout", "teacher_loss"), 3),
        ("MC acc", get("eleuther", "mc_acc"), 3),
        ("executed", get("executed_fraction_mean"), 3),
        ("train s", get("wall_time_s", "train"), 0),
        ("eval s", get("wall_time_s", "eval"), 0),
    ]


def _fmt(values: Sequence[float], digits: int) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _mean_std(values: Sequence[Optional[float]]) -> Tuple[Optional[float], float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def lowest_at_equal_flops(points: Sequence[Tuple[float, float]], digits: Optional[int] = None) -> List[Tuple[float, float]]:
    """(FLOPs ratio, loss) points → one point per FLOPs, the lowest loss there, sorted by FLOPs.

    A baseline family can hold several models at the same compute (layer dropping trained with and without
    distillation); its line goes through the stronger one. ``digits`` rounds the FLOPs before they are compared
    (for means over seeds); None compares them exactly (one seed's runs, where the twins' FLOPs are equal)."""
    lowest: Dict[float, float] = {}
    for flops, loss in points:
        key = flops if digits is None else round(flops, digits)
        lowest[key] = min(loss, lowest.get(key, loss))
    return sorted(lowest.items())


def load_results(out_dir: Path) -> Tuple[Dict[str, Any], Dict[str, List[Dict[str, Any]]]]:
    out_dir = Path(out_dir)
    spec_path = out_dir / "study.json"
    spec = json.loads(spec_path.read_text()) if spec_path.is_file() else {}
    runs: Dict[str, List[Dict[str, Any]]] = {}
    for path in sorted((out_dir / "runs").glob("*.json")):
        result = json.loads(path.read_text())
        runs.setdefault(result["name"], []).append(result)
    for results in runs.values():
        results.sort(key=lambda r: r["seed"])
    return spec, runs


def _mean_curve(results: List[Dict[str, Any]], key: str) -> Tuple[List[int], List[float]]:
    by_step: Dict[int, List[float]] = {}
    for r in results:
        curves = r.get("curves") or {}
        values = (curves.get("series") or {}).get(key)
        if not values:
            continue
        for step, value in zip(curves["steps"], values):
            if value is not None:
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def make_plots(out_dir: Path, order: List[str], runs: Dict[str, List[Dict[str, Any]]], dense_names: List[str]) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    names = [n for n in order if runs.get(n)]
    # Ten colours, then the next ten runs with another marker and line style: every run keeps its own look
    # however many a study has.
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    markers = {n: "os^Dv*"[(i // 10) % 6] for i, n in enumerate(names)}
    lines = {n: ("-", "--", ":", "-.")[(i // 10) % 4] for i, n in enumerate(names)}
    written = []

    def finish(fig, ax, name, empty_note, integer_x=True):
        if integer_x:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        fig.tight_layout()
        if not ax.has_data():
            ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes)
        elif ax.get_legend_handles_labels()[0]:
            # Placed after the layout, one column per 24 entries, the saved canvas grown to hold it (bbox_inches):
            # the axes keep their size, and a study of many runs loses no name off the figure's edge.
            entries = len(ax.get_legend_handles_labels()[0])
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                      ncol=math.ceil(entries / 24))
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    # (a) frontier: student held-out loss against forward FLOPs ratio. Coloured by family (dense, layer dropping,
    # random, MoD, SDT, STT) and named on the plot: a study has more runs than a legend can tell apart. The two
    # static baselines are joined across FLOP levels and to dense (their point at 1.0), so a routed run below
    # their line beats them at its compute (the comparison experiments/frontier/targets.py makes).
    fns = dict((h, f) for h, f, _ in _metric_fns())
    family_colors = {"dense": "black", "layerdrop": "tab:orange", "random": "tab:gray", "mod": "tab:purple",
                     "sdt": "tab:green", "stt": "tab:blue"}
    marks = []  # (name, family, x mean, x std, y mean, y std)
    for n in names:
        xm, xs = _mean_std([fns["fwd FLOPs ratio"](r) for r in runs[n]])
        ym, ys = _mean_std([fns["student loss"](r) for r in runs[n]])
        if xm is not None and ym is not None:
            marks.append((n, str(runs[n][0].get("variant", "?")), xm, xs, ym, ys))
    dense_losses = [(n, _mean_std([r["heldout"]["student_loss"] for r in runs.get(n, [])])[0]) for n in dense_names]
    # A study of many recipes puts dozens at one FLOP level, so only each family's Pareto front is named (no run
    # of the same family at fewer or equal FLOPs with a lower or equal loss): the runs a reader compares. Every
    # point is still drawn, and the tables name them all.
    named = {n for n, family, xm, _, ym, _ in marks
             if not any(f == family and o != n and x <= xm and y <= ym for o, f, x, _, y, _ in marks)}
    # Named points close in FLOPs take turns above and below their marker, so two fronts crossing stay legible.
    label_offset = {n: (4, 3 if i % 2 == 0 else -9)
                    for i, n in enumerate(sorted(named, key=lambda n: next(m[2] for m in marks if m[0] == n)))}
    # Left: every run. Right: the band between dense and the layer-dropping line, where the comparisons are.
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    for ax in axes:
        seen = set()
        for n, family, xm, xs, ym, ys in marks:
            color = family_colors.get(family, "tab:brown")
            ax.errorbar([xm], [ym], xerr=[xs], yerr=[ys], fmt="o", markersize=4, capsize=2, color=color,
                        label=None if family in seen else family)
            if n in named:
                ax.annotate(f"{n} ({len(runs[n])})", (xm, ym), textcoords="offset points", xytext=label_offset[n],
                            fontsize=6, color=color)
            seen.add(family)
        for family in ("layerdrop", "random"):
            # At equal FLOPs (layer dropping with and without distillation) the line takes the lower loss: the
            # stronger baseline, as targets.py does per seed.
            xy = lowest_at_equal_flops([(xm, ym) for _, f, xm, _, ym, _ in marks if f in (family, "dense")], digits=3)
            if any(f == family for _, f, *_ in marks) and len(xy) > 1:
                ax.plot([x for x, _ in xy], [y for _, y in xy], "-", color=family_colors[family], linewidth=1,
                        alpha=0.6)
        for n, ym in dense_losses:
            if ym is not None:
                ax.axhline(ym, color="gray", linestyle="--", linewidth=1, label=f"{n} (reference)")
        ax.set_xlabel("forward FLOPs per token ÷ dense (closed form)")
        ax.set_ylabel("held-out loss per token (student)")
    axes[0].set_title("Quality–compute frontier (mean ± std over seeds; (n) = seeds;\nnamed: each family's "
                      "Pareto front)")
    drop_losses = [ym for _, f, _, _, ym, _ in marks if f == "layerdrop"]
    floor = min([ym for _, ym in dense_losses if ym is not None] + [ym for *_, ym, _ in marks], default=None)
    if drop_losses and floor is not None:
        axes[1].set_ylim(floor - 0.05, max(drop_losses) + 0.15)
        axes[1].set_title("zoom: dense to the layer-dropping line")
    else:
        axes[1].set_title("zoom (no layer-dropping run yet)")
    # the legend right of the last panel, where the canvas grows to hold it
    finish(fig, axes[-1], "frontier.png", "no run with held-out loss and FLOPs yet", integer_x=False)

    # (b) training curves
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for n in names:
        steps, values = _mean_curve(runs[n], "loss/lm")
        if steps:
            ax.plot(steps, values, lines[n], color=colors[n], label=n)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training LM loss (mean over seeds)")
    ax.set_title("Training curves")
    finish(fig, ax, "curves.png", "no training curve yet")

    # (c) validation: student vs teacher
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for n in names:
        for key, style, label in (("val/lm_loss_student", "-", "student"), ("val/lm_loss_teacher", "--", "teacher")):
            steps, values = _mean_curve(runs[n], key)
            if steps and not (label == "teacher" and all(r.get("variant") == "dense" for r in runs[n])):
                ax.plot(steps, values, style, marker=markers[n], markersize=3, color=colors[n], label=f"{n} {label}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation LM loss (mean over seeds)")
    ax.set_title("Validation: student (solid) vs teacher (dashed)")
    finish(fig, ax, "validation.png", "no validation point yet")

    # (d) executed fraction per layer (student, held-out windows)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for n in names:
        layers = sorted({int(k) for r in runs[n] for k in (r.get("executed_fraction") or {})})
        if not layers:
            continue
        means = [statistics.fmean([r["executed_fraction"][str(l)] for r in runs[n] if str(l) in r["executed_fraction"]])
                 for l in layers]
        ax.plot(layers, means, lines[n], marker=markers[n], color=colors[n], label=n)
    ax.set_xlabel("layer")
    ax.set_ylabel("executed fraction (student, held-out)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Executed fraction per routed layer")
    finish(fig, ax, "executed_fraction.png", "no routed run yet")
    return written


# ---- the papers' qualitative claims (issue 14, item 4) ------------------------------------------------


def _model_cfg(r: Dict[str, Any]) -> Dict[str, Any]:
    return (r.get("config") or {}).get("model") or {}


def _layer_mean_curve(results: List[Dict[str, Any]], metric: str,
                      divided_by: Optional[str] = None) -> Tuple[List[int], List[float]]:
    """Per step, the mean over routed layers (then over seeds) of ``routing/layer_i/<metric>``, or of its ratio
    to ``routing/layer_i/<divided_by>`` per layer (a scale-free mean when layers differ in scale)."""
    by_step: Dict[int, List[float]] = {}
    for r in results:
        series = (r.get("curves") or {}).get("series") or {}
        keys = [k for k in series if k.startswith("routing/layer_") and k.endswith("/" + metric)]
        for i, step in enumerate((r.get("curves") or {}).get("steps") or []):
            if divided_by is None:
                values = [series[k][i] for k in keys if series[k][i] is not None]
            else:
                pairs = [(series[k][i], (series.get(k[: -len(metric)] + divided_by) or [None] * (i + 1))[i]) for k in keys]
                values = [num / den for num, den in pairs if num is not None and den]
            if values:
                by_step.setdefault(step, []).append(statistics.fmean(values))
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def _layer_values(results: List[Dict[str, Any]], key: str) -> Dict[int, float]:
    """Per layer, the mean over seeds of ``layers[l][key]`` (held-out report)."""
    per: Dict[int, List[float]] = {}
    for r in results:
        for layer, row in (r.get("layers") or {}).items():
            if key in row:
                per.setdefault(int(layer), []).append(row[key])
    return {layer: statistics.fmean(v) for layer, v in sorted(per.items())}


def unexplained_update_share(results: List[Dict[str, Any]]) -> Optional[float]:
    """Mean over routed layers of held-out D_ch / D_st: the share of the block's update (its squared norm) that
    the PriorFFN/TPN leaves unexplained (1 = it predicts nothing, 0 = exactly). Scale-free per layer, unlike
    ``loss/pred``, the raw MSE averaged over layers, which one layer with massive activations decides (in
    SmolLM2-135M layer 11's update has D_st ≈ 2,000–4,000 against ≤ 35 elsewhere, ~99 % of the mean)."""
    change, static = _layer_values(results, "teacher/d_ch"), _layer_values(results, "teacher/d_st")
    ratios = [change[layer] / static[layer] for layer in change if static.get(layer)]
    return statistics.fmean(ratios) if ratios else None


def _slope(xs: List[float], ys: List[float]) -> Optional[float]:
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return None if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def claims_section(out_dir: Path, order: List[str], runs: Dict[str, List[Dict[str, Any]]],
                   plotted: Optional[List[str]] = None) -> List[str]:
    """Numbers and a 5-panel plot (``claims.png``) for the papers' qualitative claims: training LM loss of the
    routed runs (Fig. 2A); predictor loss of the PriorFFN (SDT) vs the TPN (STT) over training (Fig. 2B); STT dynamic capacity per layer (Fig. 2C: does it
    fall with depth?); the shares of the teacher's choices whose CE and whose CU criterion fired, early vs
    late in training; teacher–student agreement per layer, STT vs SDT. The verdicts, which need three seeds,
    are the frontier study's ``experiments/frontier/claims.py``.

    The table has every SDT/STT run; the plot draws those in ``plotted`` (the study's ``claims_runs``), or all of
    them when it is ``None`` (twenty runs make four unreadable legends)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in order if runs.get(n)]
    drawn = set(names if plotted is None else plotted)
    surprise = [n for n in names if runs[n][0].get("variant") in ("sdt", "stt")]
    dynamic = [n for n in surprise if _model_cfg(runs[n][0]).get("teacher_selection") == "threshold"]
    fig, grid = plt.subplots(3, 2, figsize=(11, 12))
    axes = {"2A": grid[0, 0], "2B": grid[0, 1], "2C": grid[1, 0], "shares": grid[1, 1], "agreement": grid[2, 0]}
    grid[2, 1].axis("off")
    # Fig. 2A: the training LM loss of the routed runs (MoD too), as the paper compares them
    for n in names:
        if runs[n][0].get("variant") in ROUTED_VARIANTS and n in drawn:
            steps, lm = _mean_curve(runs[n], "loss/lm")
            if steps:
                axes["2A"].plot(steps, lm, "-" if runs[n][0]["variant"] == "stt" else "--" if runs[n][0]["variant"]
                                == "sdt" else ":", label=f"{n} ({len(runs[n])} seeds)")
    lines = ["## The papers' claims", "",
             "| run | variant | seeds | predictor loss first → last | update share unexplained (held-out D_ch/D_st) "
             "| CE share first → last | CU share first → last | agreement (held-out) |", "|---|---|---|---|---|---|---|---|"]
    for n in surprise:
        rs = runs[n]
        steps, pred = _mean_curve(rs, "loss/pred")
        share_steps, share = _layer_mean_curve(rs, "d_ch", divided_by="d_st")
        ce_steps, ce = _layer_mean_curve(rs, "teacher_ce_share")
        _, cu = _layer_mean_curve(rs, "teacher_cu_share")
        agreement = _layer_values(rs, "teacher/agreement_accuracy")
        style = "-" if rs[0]["variant"] == "stt" else "--"
        if share_steps and n in drawn:
            axes["2B"].plot(share_steps, share, style, label=f"{n} ({'TPN' if rs[0]['variant'] == 'stt' else 'PriorFFN'})")
        if ce_steps and n in drawn:
            (ce_line,) = axes["shares"].plot(ce_steps, ce, style, label=f"{n} CE")
            axes["shares"].plot(ce_steps, cu, ":", color=ce_line.get_color(), label=f"{n} CU")
        if agreement and n in drawn:
            axes["agreement"].plot(list(agreement), list(agreement.values()), style, marker="o", label=n)
        fmt = lambda v: f"{v[0]:.3g} → {v[-1]:.3g}" if v else "–"  # noqa: E731
        mean_agreement = f"{statistics.fmean(agreement.values()):.3f}" if agreement else "–"
        unexplained = unexplained_update_share(rs)
        unexplained = "–" if unexplained is None else f"{unexplained:.3f}"
        lines.append(f"| {n} | {rs[0]['variant']} | {len(rs)} | {fmt(pred)} | {unexplained} | {fmt(ce)} | {fmt(cu)} "
                     f"| {mean_agreement} |")
    for n in dynamic:
        fractions = _layer_values(runs[n], "teacher/teacher_fraction")
        if fractions and n in drawn:
            axes["2C"].plot(list(fractions), list(fractions.values()), marker="o", label=f"{n} teacher")
            student = _layer_values(runs[n], "student/selected_fraction")
            axes["2C"].plot(list(student), list(student.values()), "--", marker=".", label=f"{n} student")
            slope = _slope([float(l) for l in fractions], list(fractions.values()))
            lines += ["", f"Dynamic capacity (`{n}`, held-out, teacher g ≥ g_th): per layer "
                      + ", ".join(f"{l}: {v:.2f}" for l, v in fractions.items())
                      + (f"; least-squares slope {slope:+.4f} per layer (negative = falls with depth)." if slope is not None else ".")]
    for ax, title, xlabel, ylabel in (
        (axes["2A"], "Fig. 2A: training LM loss (mean over seeds; STT solid, SDT dashed, MoD dotted)",
         "optimizer step", "LM loss"),
        # Not the raw L_pred the paper plots: one layer's massive update decides that mean (unexplained_update_share)
        (axes["2B"], "Fig. 2B: share of the update the predictor leaves unexplained\n(PriorFFN dashed, TPN solid)",
         "optimizer step", "D_ch / D_st, mean over routed layers"),
        (axes["2C"], "Fig. 2C: STT dynamic capacity per layer", "layer", "executed fraction"),
        (axes["shares"], "Share of the teacher's choices whose CE / CU fired (CU dotted)", "optimizer step", "share"),
        (axes["agreement"], "Teacher–student agreement per layer (STT solid, SDT dashed)", "layer", "accuracy"),
    ):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ax.has_data():
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no run of this kind yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out_dir / "claims.png", dpi=110)
    plt.close(fig)
    if not surprise:
        lines.append("| (no SDT/STT run yet) | | | | | | | |")
    return lines + ["", "![claims.png](claims.png)", ""]


def aggregate(out_dir: Path) -> Path:
    """Write ``<out_dir>/README.md`` and the plots from the run JSONs present (a partial study is fine)."""
    out_dir = Path(out_dir)
    spec, runs = load_results(out_dir)
    stale_lines = []
    for run_spec in spec.get("runs", []):
        if run_spec["name"] not in runs or not Path(run_spec["config"]).is_file():
            continue
        current = []
        for result in runs[run_spec["name"]]:
            keys = stale_keys(spec, run_spec, result)
            current.append(result) if not keys else stale_lines.append(
                f"- `{run_id(result['name'], result['seed'])}`: trained with other {', '.join(keys)} than the study now defines")
        runs[run_spec["name"]] = current
    runs = {n: rs for n, rs in runs.items() if rs}
    expected_names = [r["name"] for r in spec.get("runs", [])]
    order = expected_names + sorted(n for n in runs if n not in expected_names)
    expected_seeds = [int(s) for s in spec.get("seeds", [])]
    baselines = [b for b in spec.get("baselines", [])]
    name = spec.get("name") or next((r["study"] for rs in runs.values() for r in rs), out_dir.name)
    dense_names = [n for n in order if runs.get(n) and all(r.get("variant") == "dense" for r in runs[n])]

    missing_lines = []
    status = {}
    for n in order:
        seeds = [r["seed"] for r in runs.get(n, [])]
        lacking = [s for s in expected_seeds if s not in seeds]
        if not seeds:
            status[n] = "none (missing)"
            missing_lines.append(f"- `{n}`: no seed finished (expected {expected_seeds})")
        elif lacking:
            status[n] = f"{len(seeds)}/{len(expected_seeds)} (partial)"
            missing_lines.append(f"- `{n}`: seeds {lacking} missing (have {seeds})")
        else:
            status[n] = f"{len(seeds)}" + (f"/{len(expected_seeds)}" if expected_seeds else "")
    partial = bool(missing_lines)

    fns = _metric_fns()
    lines = [f"# Study `{name}`", ""]
    lines.append("Written by `python experiments/study.py aggregate` from the run JSONs in `runs/` "
                 f"({sum(len(v) for v in runs.values())} files).")
    if spec.get("source"):
        lines.append(f"Study file: `{os.path.relpath(spec['source'], out_dir) if os.path.isabs(spec['source']) else spec['source']}`.")
    lines.append("")
    if not spec:
        lines += ["No `study.json` here (written by `run`): the expected runs and seeds are unknown, the tables show "
                  "the run files present.", ""]
    elif partial:
        lines += ["**PARTIAL STUDY** — missing:", "", *missing_lines, ""]
    else:
        lines += ["Complete: every run has every seed of the study.", ""]
    if stale_lines:
        lines += ["**Stale results, left out of every table** (the study file or a config changed after they "
                  "finished; `study.py run --rerun-stale` retrains them):", "", *stale_lines, ""]
    budget = spec.get("budget")
    heldout = spec.get("heldout") or {}
    if budget is not None:
        lines.append(f"Budget (every run): `{json.dumps(budget)}`; seeds {expected_seeds}; held-out "
                     f"{heldout.get('windows')} windows × {heldout.get('seq_len')} tokens.")
        lines.append("")

    lines += ["## Runs", "",
              "Mean ± std over the seeds present. FLOPs and KV ratios: closed form per token against the dense model of the "
              "same shape at the held-out length, with the student's executed fraction measured on the held-out windows; "
              "losses per token on the held-out windows (student = deployed causal routing; teacher = β at the schedule's "
              "end); MC acc = mean `acc` of the eleuther_eval tasks; executed = mean over routed layers.", ""]
    header = ["run", "seeds"] + [h for h, _, _ in fns]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for n in order:
        results = runs.get(n, [])
        cells = [f"`{n}`", status[n]] + [_fmt([fn(r) for r in results], d) for _, fn, d in fns]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")

    paired_metrics = [("student loss", "Δ student loss"), ("MC acc", "Δ MC acc"), ("fwd FLOPs ratio", "Δ FLOPs ratio")]
    metric_of = {h: f for h, f, _ in fns}
    for base in baselines:
        lines += [f"## Paired differences against `{base}`", "",
                  "Per seed: run − baseline on the same seed (same data order and routing initialisation); mean, "
                  "standard error and 95 % interval from Student's t with n − 1 degrees of freedom (n = seeds both have).", ""]
        lines.append("| run | n | " + " | ".join(f"{label} mean | SE | 95 % CI" for _, label in paired_metrics) + " |")
        lines.append("|" + "---|" * (2 + 3 * len(paired_metrics)))
        base_by_seed = {r["seed"]: r for r in runs.get(base, [])}
        unpaired = []
        for n in order:
            if n == base:
                continue
            cells = [f"`{n}`"]
            pairs = [(r, base_by_seed[r["seed"]]) for r in runs.get(n, []) if r["seed"] in base_by_seed]
            if not pairs:
                unpaired.append(f"`{n}`")
                continue
            cells.append(str(len(pairs)))
            for metric, _ in paired_metrics:
                fn = metric_of[metric]
                diffs = [fn(a) - fn(b) for a, b in pairs if fn(a) is not None and fn(b) is not None]
                pd = paired_difference(diffs)
                if pd["mean"] is None:
                    cells += ["–", "–", "–"]
                    continue
                cells.append(f"{pd['mean']:+.3f}")
                cells.append("–" if pd["se"] is None else f"{pd['se']:.3f}")
                cells.append("– (n < 2)" if pd["ci95"] is None else f"[{pd['ci95'][0]:+.3f}, {pd['ci95'][1]:+.3f}]")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if not base_by_seed:
            lines += [f"Baseline `{base}` has no finished seed yet: no pairs.", ""]
        elif unpaired:
            lines += [f"No seed paired with `{base}` yet: {', '.join(unpaired)}.", ""]

    lines += test_section(order, runs, baselines)
    plots = make_plots(out_dir, order, runs, dense_names)
    titles = {"frontier.png": "Frontier: student held-out loss vs forward FLOPs ratio (dense: dashed line)",
              "curves.png": "Training LM loss (mean over seeds)",
              "validation.png": "Validation loss, student vs teacher",
              "executed_fraction.png": "Executed fraction per routed layer (student, held-out windows)"}
    lines += ["## Plots", ""]
    for plot in plots:
        lines += [f"### {titles[plot]}", "", f"![{plot}]({plot})", ""]
    lines += claims_section(out_dir, order, runs, spec.get("claims_runs"))
    lines += ["## Run files", ""]
    for n in order:
        files = ", ".join(f"[seed {r['seed']}](runs/{run_id(n, r['seed'])}.json)" for r in runs.get(n, []))
        lines.append(f"- `{n}`: {files or 'none yet'}")
    lines.append("")
    readme = out_dir / "README.md"
    readme.write_text("\n".join(lines))
    print(f"== wrote {readme} and {', '.join(plots)}", flush=True)
    return readme


def cmd_aggregate(args: argparse.Namespace) -> int:
    aggregate(Path(args.out_dir))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/study.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and evaluate every (run, seed) of a study that has no result JSON yet")
    run.add_argument("study", help="study YAML")
    run.add_argument("--only", nargs="+", metavar="NAME", help="only these runs")
    run.add_argument("--seeds", nargs="+", type=int, help="these seeds instead of the study's")
    run.add_argument("--no-aggregate", action="store_true", help="do not rewrite <out_dir>/README.md afterwards")
    run.add_argument("--dry-run", action="store_true", help="print the training commands, run nothing")
    run.add_argument("--rerun-stale", action="store_true",
                     help="retrain finished runs whose study definition changed since (default: report them and fail)")
    run.set_defaults(fn=cmd_run)
    agg = sub.add_parser("aggregate", help="write <out_dir>/README.md and the plots from the run JSONs")
    agg.add_argument("out_dir")
    agg.set_defaults(fn=cmd_aggregate)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
