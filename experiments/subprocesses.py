"""Child processes of a study, offline: torchtune's CLI, their environment and logs, and atomic JSON writes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

#: The checkout the package sits in: child processes import its torchtune_dtf and benchmarks first.
REPO = Path(__file__).resolve().parents[1]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


def tune_command() -> List[str]:
    """torchtune's ``tune`` beside this interpreter, or the same CLI as a module where there is no script."""
    tune = Path(sys.executable).with_name("tune")
    return [str(tune)] if tune.is_file() else [sys.executable, "-m", "torchtune._cli.tune"]


def subprocess_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment with the hub switched off and the checkout first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def run_logged(command: List[str], log_file: Path, cwd: Path, env: Dict[str, str]) -> Tuple[int, float]:
    """Run ``command`` with its output in ``log_file`` (the command on the first line): (return code, seconds)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_file, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        proc = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc.returncode, time.perf_counter() - start


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def write_json(path: Path, data: Any, text: Optional[str] = None) -> None:
    """Atomic write with a temporary name of its own: workers of one study started side by side each write the
    same ``study.json``, and with one shared temporary name the second rename found it gone. ``text``: the
    serialised content as it is, instead of ``data`` dumped with one-space indents."""
    from torchtune_dtf.atomic_write import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text if text is not None else json.dumps(data, indent=1))
