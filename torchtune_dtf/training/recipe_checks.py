"""What ``routed_finetune`` checks before it trains: the config's keys and values, and whether a checkpoint
may be resumed with it.

Every check fails before any work (no model built, nothing written) with one message that names every
problem and what to do about it.

Resume is exact or refused. A checkpoint carries the resume-invariant part of the config it was trained
with (:func:`resume_fingerprint`, under ``"resume_fingerprint"`` in the recipe state, beside the run id and
step written by :class:`~torchtune_dtf.training.RoutedHFCheckpointer`). :func:`check_resumable` refuses a
config that changes what the rest of the run computes (model, data, batch, optimizer, learning rates,
schedules…); :func:`check_resume_length` refuses a finished run unless it is extended on purpose
(``resume_from_checkpoint: extend`` with a larger ``epochs`` or ``max_steps_per_epoch``).
"""

import math
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from torchtune_dtf.models.model_config import model_variant
from torchtune_dtf.models.routing_config import KEYS_ADDED_LATER, STATIC_VARIANTS
from torchtune_dtf.modules import ROUTING_MODULE_GROUPS

#: Optimizer groups besides the backbone, each with its own learning rate: derived from the routing modules.
PARAM_GROUPS = tuple(dict.fromkeys(ROUTING_MODULE_GROUPS.values()))
#: Groups whose learning rate a config needs only when its model has their modules: ``skip_maps`` (the skip linear
#: maps) exists with ``model.skip_update: linear`` alone, and every config written before it has no such key.
GROUPS_OF_SKIP_UPDATE = {"skip_maps": "linear"}
REQUIRED_KEYS = (
    "model",
    "tokenizer",
    "checkpointer",
    "dataset",
    "seed",
    "shuffle",
    "batch_size",
    "epochs",
    "max_steps_per_epoch",
    "gradient_accumulation_steps",
    "clip_grad_norm",
    "optimizer",
    "learning_rates",
    "lr_scheduler",
    "loss",
    "freeze_base",
    "resume_from_checkpoint",
    "save_every_n_steps",
    "validation",
    "device",
    "dtype",
    "enable_activation_checkpointing",
    "compile",
    "metric_logger",
    "log_every_n_steps",
    "output_dir",
    "distillation",
)
ROUTED_KEYS = ("routing_loss_weights", "beta_schedule", "scheduled_sampling", "capacity_curriculum", "student_calibration")
#: Config entries a resumed run must share with its checkpoint: each changes what the rest of the run computes.
RESUME_INVARIANT_KEYS = (
    "model", "tokenizer.max_seq_len", "dataset", "seed", "shuffle", "batch_size", "gradient_accumulation_steps",
    "clip_grad_norm", "optimizer", "learning_rates", "lr_scheduler", "loss", "freeze_base", "dtype",
    "routing_loss_weights", "beta_schedule", "scheduled_sampling", "capacity_curriculum", "distillation",
    "epochs", "max_steps_per_epoch",
)
#: Fingerprint entries added after checkpoints had been written, each with the value under which a run computes
#: what it computed before the entry existed. A checkpoint that lacks the entry resumes while the config holds
#: that value; any other value is a change like every other. The study driver reads the same table for results.
ADDED_FINGERPRINT_ENTRIES: Dict[str, Any] = {f"model.{key}": value for key, value in KEYS_ADDED_LATER.items()}
#: What ``resume_from_checkpoint: extend`` may change: the length of the run.
EXTENDABLE_KEYS = ("epochs", "max_steps_per_epoch")
RESUME_MODES = (False, True, "extend")


# ------------------------------------------------------------------------------------------ config
def validate_recipe_config(cfg: DictConfig) -> None:
    """Fail before any work with one message naming every missing or misplaced key, then every bad value.

    The variant ``cfg.model`` builds (read from the config, :func:`~torchtune_dtf.models.model_config.model_variant`)
    decides which sections are needed: a routed variant needs the routing sections, a static one (dense, layer
    dropping) does not.

    Args:
        cfg (DictConfig): the recipe's config, overrides merged.
    """
    variant = model_variant(OmegaConf.to_container(cfg.model, resolve=True)) if "model" in cfg else None
    missing = [key for key in REQUIRED_KEYS if key not in cfg]
    sections = [("distillation", ("weight", "temperature"))]
    if variant is not None and variant not in STATIC_VARIANTS:
        missing += [key for key in ROUTED_KEYS if key not in cfg]
        sections += [
            ("routing_loss_weights", ("pred", "causal", "g_reg", "warmup_steps")),
            ("beta_schedule", ("type", "beta_ce_start", "beta_ce_end", "beta_cu_start", "beta_cu_end", "warmup_steps")),
            ("scheduled_sampling", ("share_start", "share_end", "ramp_steps")),
            ("capacity_curriculum", ("ramp_steps",)),
            ("student_calibration", ("batches", "rounds")),
        ]
    for section, keys in sections:
        if section in cfg:
            missing += [f"{section}.{key}" for key in keys if key not in cfg[section]]
    if "learning_rates" in cfg:
        needed = [g for g in ("backbone", *PARAM_GROUPS)
                  if g not in GROUPS_OF_SKIP_UPDATE or cfg.model.get("skip_update") == GROUPS_OF_SKIP_UPDATE[g]]
        missing += [f"learning_rates.{g}" for g in needed if g not in cfg.learning_rates]
    if "validation" in cfg:
        missing += [f"validation.{k}" for k in ("every_n_steps", "max_batches") if k not in cfg.validation]
    if missing:
        raise ValueError(f"Config is missing required key(s): {', '.join(missing)}")
    _check_values(cfg, variant)


def check_resume_mode(resume_from_checkpoint: Any) -> None:
    """``resume_from_checkpoint`` is one of :data:`RESUME_MODES`."""
    if resume_from_checkpoint not in RESUME_MODES:
        raise ValueError(f"resume_from_checkpoint must be one of {RESUME_MODES}, got {resume_from_checkpoint!r}")


def _float(value: Any) -> float:
    try:
        return float(value)  # YAML reads 1e-3 (no dot) as a string
    except (TypeError, ValueError):
        return math.nan


def _check_values(cfg: DictConfig, variant: Optional[str]) -> None:
    """Values that would make a run do nothing, the wrong thing, or crash after its first step."""
    problems = []
    positive = {
        "epochs": cfg.epochs, "batch_size": cfg.batch_size, "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "save_every_n_steps": cfg.save_every_n_steps, "log_every_n_steps": cfg.log_every_n_steps,
        "validation.every_n_steps": cfg.validation.every_n_steps, "validation.max_batches": cfg.validation.max_batches,
    }
    if cfg.max_steps_per_epoch is not None:
        positive["max_steps_per_epoch"] = cfg.max_steps_per_epoch
    problems += [f"{key} must be a positive integer, got {value!r}" for key, value in positive.items()
                 if not (isinstance(value, int) and not isinstance(value, bool) and value > 0)]
    # A negative learning rate is gradient ascent; 0 freezes a group, which freeze_base/LoRA say more clearly but is allowed.
    problems += [f"learning_rates.{group} must be ≥ 0, got {lr!r}" for group, lr in cfg.learning_rates.items()
                 if not _float(lr) >= 0]
    if cfg.clip_grad_norm is not None and not cfg.clip_grad_norm > 0:
        problems.append(f"clip_grad_norm must be > 0 or null, got {cfg.clip_grad_norm!r}")
    if "student_calibration" in cfg:
        problems += _calibration_problems(cfg, variant)
    if "skip_bias_init" in cfg:
        problems += _skip_bias_init_problems(cfg)
    if problems:
        raise ValueError("Invalid config values:\n  - " + "\n  - ".join(problems))


def _calibration_problems(cfg: DictConfig, variant: Optional[str]) -> List[str]:
    # A static variant need not carry the section; `student_calibration.batches=0` on its command line (a script
    # that trains dense and routed with one command) is then the only key, and rounds are never used.
    batches, rounds = cfg.student_calibration.get("batches"), cfg.student_calibration.get("rounds")
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if not (is_int(batches) and batches >= 0):
        return [f"student_calibration.batches must be an integer ≥ 0 (0 = off), got {batches!r}"]
    if batches == 0:
        return []
    if not (is_int(rounds) and rounds >= 1):
        return [f"student_calibration.rounds must be a positive integer, got {rounds!r}"]
    if variant == "random":
        return ["student_calibration.batches > 0, but variant 'random' has no causal router to calibrate (its "
                "student runs Bernoulli(γ), on budget in expectation); set student_calibration.batches: 0"]
    mode = cfg.model.get("student_routing_mode")
    if mode in ("topk", "window_topk"):
        return [f"student_calibration.batches > 0, but student_routing_mode {mode!r} already runs γ by rank; "
                "calibration shifts the threshold of a 'threshold' student. Set student_calibration.batches: 0"]
    return []


def _skip_bias_init_problems(cfg: DictConfig) -> List[str]:
    # Optional section (absent: the skip updates start at zero, as before it existed); present, it must say how many
    # batches, and for linear maps the ridge of their least-squares fit.
    section = cfg.skip_bias_init if isinstance(cfg.skip_bias_init, DictConfig) else DictConfig({})
    batches = section.get("batches")
    if not (isinstance(batches, int) and not isinstance(batches, bool) and batches >= 0):
        return [f"skip_bias_init.batches must be an integer ≥ 0 (0 = the skip updates start at zero), got {batches!r}"]
    skip_update = cfg.model.get("skip_update")
    if batches and skip_update not in ("bias", "linear"):
        return [f"skip_bias_init.batches > 0 sets skip biases or linear maps, but model.skip_update is {skip_update!r} "
                "(none to set); use model.skip_update: bias or linear, or skip_bias_init.batches: 0"]
    if batches and skip_update == "linear":
        if "ridge" not in section:
            return ["skip_bias_init.ridge is missing: model.skip_update: linear fits each map by ridge regression "
                    "(e.g. 0.01; 0 = plain least squares)"]
        if not _float(section.ridge) >= 0:
            return [f"skip_bias_init.ridge must be ≥ 0, got {section.ridge!r}"]
    return []


# ------------------------------------------------------------------------------------------ resume
def resume_fingerprint(cfg: DictConfig, world_size: int) -> Dict[str, Any]:
    """The resume-invariant part of ``cfg``, flattened to ``dotted.key: value`` (interpolations resolved)."""
    flat: Dict[str, Any] = {"world_size": world_size}

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}.{k}", v)
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                add(f"{key}.{i}", v)
        else:
            flat[key] = value

    for key in RESUME_INVARIANT_KEYS:
        value = OmegaConf.select(cfg, key)
        add(key, OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)
    return flat


def check_resumable(checkpoint: Dict[str, Any], fingerprint: Dict[str, Any], folder: Path, extend: bool) -> None:
    """Refuse to resume with a config that changes what the rest of the run computes.

    Args:
        checkpoint (Dict[str, Any]): the recipe state loaded from ``folder``.
        fingerprint (Dict[str, Any]): :func:`resume_fingerprint` of this run's config.
        folder (Path): the checkpoint folder being resumed, named in the messages.
        extend (bool): ``resume_from_checkpoint: extend``: the :data:`EXTENDABLE_KEYS` may differ.
    """
    saved = checkpoint.get("resume_fingerprint")
    if saved is None:
        raise ValueError(f"{folder} holds no resume fingerprint (written by an older version): it cannot be resumed exactly")
    absent = "<absent>"
    # Only entries the config has: a variant without the key (dense has no skip_update) has nothing to compare.
    saved = {**{key: off for key, off in ADDED_FINGERPRINT_ENTRIES.items()
                if key not in saved and key in fingerprint}, **saved}
    diffs = [
        f"{key}: checkpoint {saved.get(key, absent)!r}, config {fingerprint.get(key, absent)!r}"
        for key in sorted(set(saved) | set(fingerprint))
        if saved.get(key, absent) != fingerprint.get(key, absent)
        and not (extend and key.split(".")[0] in EXTENDABLE_KEYS)
    ]
    if diffs:
        raise ValueError(
            f"Cannot resume {folder} exactly: the config differs from the one it was trained with:\n  - "
            + "\n  - ".join(diffs)
            + "\nRestore those values to resume. To train with the new ones, start a new run from its weights "
            f"(checkpointer.checkpoint_dir={folder}, a fresh output_dir). Changing only epochs or "
            "max_steps_per_epoch is resume_from_checkpoint: extend."
        )


def check_resume_length(folder: Path, done: int, planned_steps: int, total_steps: int, extend: bool) -> None:
    """A finished run is only continued on purpose (``extend``); otherwise the length must be unchanged.

    Args:
        folder (Path): the checkpoint folder being resumed, named in the messages.
        done (int): optimizer steps the checkpoint has done.
        planned_steps (int): the run's length when the checkpoint was written.
        total_steps (int): the length this config and data give.
        extend (bool): ``resume_from_checkpoint: extend``: the run must then get longer.
    """
    if extend:
        if total_steps <= done:
            raise ValueError(
                f"resume_from_checkpoint: extend, but this config trains {total_steps} steps and {folder} "
                f"has done {done}: raise epochs or max_steps_per_epoch"
            )
    elif done >= planned_steps:
        raise ValueError(
            f"{folder} is the end of a finished run (step {done} of {planned_steps}); resuming would retrain and "
            "overwrite its final model. To train it further, raise epochs or max_steps_per_epoch and set "
            f"resume_from_checkpoint: extend; to start a new run from its weights, use checkpointer.checkpoint_dir={folder} "
            "and a fresh output_dir."
        )
    elif total_steps != planned_steps:
        raise ValueError(
            f"Cannot resume {folder} exactly: the run was planned for {planned_steps} steps and this config and "
            f"data give {total_steps} (the dataset changed length?); the LR and β schedules would change"
        )
