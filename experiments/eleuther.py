"""The multiple-choice step of a run: torchtune's stock ``tune run eleuther_eval`` on the final checkpoint, offline,
and lm-eval's results table read back from its log."""

import statistics
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

from experiments import StudyError
from experiments.subprocesses import REPO, run_logged, subprocess_env, tail, tune_command


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

    from torchtune_dtf.models.model_config import merged_model_config
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
    returncode, _ = run_logged(command, log_file, REPO, subprocess_env())
    if returncode != 0:
        raise StudyError(f"writing the offline gpt2 stand-in failed; see {log_file}:\n{tail(log_file)}")


def run_eleuther(study: Dict[str, Any], rid: str, saved_config: Path, checkpoint_dir: Path) -> Tuple[Dict[str, Any], float]:
    """Evaluate the run ``rid`` with the stock recipe: (its ``eleuther`` result section, seconds)."""
    from omegaconf import OmegaConf

    work = Path(study["work_dir"])
    eval_dir = work / "runs" / rid / "eleuther"
    eval_dir.mkdir(parents=True, exist_ok=True)
    cfg = eleuther_config(study, saved_config, checkpoint_dir, eval_dir)
    config_path = eval_dir / "eval_config.yaml"
    OmegaConf.save(OmegaConf.create(cfg), config_path)
    hf_home = work / "hf_home"
    seed_offline_hf_home(hf_home, work / "logs" / "hf_home.log")
    command = tune_command() + ["run", "eleuther_eval", "--config", str(config_path)]
    log_file = work / "logs" / rid / "eleuther.log"
    print(f"== {rid}: eleuther_eval; log {log_file}", flush=True)
    env = subprocess_env({"HF_HOME": str(hf_home), "HF_DATASETS_CACHE": str(hf_home / "datasets")})
    returncode, seconds = run_logged(command, log_file, Path(study["eleuther"]["cwd"]), env)
    text = log_file.read_text(errors="replace")
    if returncode != 0 or "Eval completed" not in text:
        raise StudyError(f"{rid}: eleuther_eval failed (exit {returncode}); see {log_file}:\n{tail(log_file)}")
    results = parse_eleuther_table(text)
    accs = [metrics["acc"] for metrics in results.values() if "acc" in metrics]
    return {
        "config": str(config_path),
        "tasks": list(cfg["tasks"]),
        "limit": cfg.get("limit"),
        "results": results,
        "mc_acc": statistics.fmean(accs) if accs else None,
    }, seconds
