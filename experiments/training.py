"""A run's training: the ``tune run`` command it trains with, whether a finished result still matches the study's
definition, and training that resumes after an interruption.

The command (``train_command``)::

    tune run torchtune_dtf/recipes/routed_finetune.py --config CFG output_dir=<work_dir>/runs/<run>__seed<k>
        seed=<k> checkpointer.routing_init_seed=<k> <budget> save_every_n_steps=E validation.every_n_steps=E
        log_every_n_steps=1 <overrides>

E is the smallest divisor of the step count that gives at most ``validation_points`` validation points (the last
step always validates); ``budget`` may set ``save_every_n_steps``/``validation.every_n_steps``/``log_every_n_steps``
itself. **Interrupted training resumes** (``train``): if the output folder holds a complete checkpoint of the run
that owns it (``run.json``), the same command is rerun with ``resume_from_checkpoint=True`` (the recipe continues
exactly or refuses with its reason); if the recipe refuses or fails on resume, or there is no checkpoint, the run
restarts from scratch in a clean folder (a checkpoint at the run's last step, from a driver stopped right after
training, is taken as it is). A finished training is marked by ``<output_dir>/study_train_done.json``. The training
wall time is the sum of the attempts since the last fresh start, an attempt killed with the driver counting until
its log's last write (attempts and their logs: ``<work_dir>/logs/<run>__seed<k>/``).
"""

import json
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from experiments import StudyError
from experiments.spec import run_id
from experiments.subprocesses import run_logged, subprocess_env, tail, tune_command, write_json

RECIPE = "torchtune_dtf/recipes/routed_finetune.py"
DONE_MARKER = "study_train_done.json"


def cli_value(value: Any) -> str:
    """A config value as `tune run` parses key=value (YAML): strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def schedule_every(steps: Optional[int], points: int) -> Optional[int]:
    """The smallest divisor of ``steps`` giving at most ``points`` multiples up to ``steps`` (the last step is one)."""
    if not steps or steps <= 0:
        return None
    for d in range(1, steps + 1):
        if steps % d == 0 and steps // d <= max(points, 1):
            return d
    return steps


def planned_steps(config_file: str, budget: Dict[str, Any], overrides: Dict[str, Any]) -> Optional[int]:
    """Epochs × max_steps_per_epoch of the config with the run's overrides and the budget (None if not both ints)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config_file)
    for key, value in {**overrides, **budget}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    steps, epochs = cfg.get("max_steps_per_epoch"), cfg.get("epochs", 1)
    return int(steps) * int(epochs) if isinstance(steps, int) and isinstance(epochs, int) else None


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


def train_command(study: Dict[str, Any], run: Dict[str, Any], seed: int, output_dir: Path,
                  resume: bool = False) -> List[str]:
    """The ``tune run`` command line that trains (or, with ``resume``, resumes) one (run, seed)."""
    args = train_overrides(study, run, seed, output_dir)
    if resume:
        args["resume_from_checkpoint"] = True
    return [*tune_command(), "run", RECIPE, "--config", run["config"], *(f"{k}={cli_value(v)}" for k, v in args.items())]


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
    from torchtune_dtf.training.recipe_checks import ADDED_FINGERPRINT_ENTRIES

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
            write_json(_attempts_file(logs_dir), attempts)
            print(f"== {rid}: training ({mode}); log {log_file}", flush=True)
            attempt["returncode"], attempt["seconds"] = run_logged(command, log_file, root, subprocess_env())
            write_json(_attempts_file(logs_dir), attempts)
            if attempt["returncode"] == 0:
                state = "finished"
                break
            print(f"== {rid}: training ({mode}) exited {attempt['returncode']}:\n{tail(log_file)}", flush=True)
        else:
            raise StudyError(f"{rid}: training failed (see {logs_dir})")
    if state == "finished":
        command = train_command(study, run, seed, output_dir)
        marker = {"train_seconds": sum(a["seconds"] for a in attempts), "attempts": attempts, "command": command}
        write_json(output_dir / DONE_MARKER, marker)
    return json.loads((output_dir / DONE_MARKER).read_text())
