"""``scripts/background.sh``: long jobs (studies) in their own session on idle time only, paused while timing.

What a user relies on: the job outlives the shell that started it and is found again by name; ``pause`` stops its
whole process group (children included) and ``resume`` continues it; its scheduling group, not the caller's, is the
one lowered (lowering the caller's would slow the very shell that times a benchmark); a second start of a running
job is refused.
"""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "background.sh"


def _run(env, *args, check=True):
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=check,
                          timeout=60)


def _states(pgid):
    out = subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line.strip()[0] for line in out.splitlines() if line.strip()]


def _autogroup(pid):
    """``(group id, nice)`` of a process's scheduling group, or None where the kernel shows none.

    Some kernels and sandboxes have the file but leave it empty (seen on CI), which means the same as no file.
    """
    path = Path(f"/proc/{pid}/autogroup")
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    match = re.fullmatch(r"/autogroup-(\d+) nice (-?\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def _wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_background_job_runs_in_its_own_lowered_group_pauses_resumes_and_is_not_started_twice(tmp_path):
    env = {**os.environ, "BACKGROUND_DIR": str(tmp_path)}
    caller_group = _autogroup(os.getpid())
    # A job with a child, so pausing must reach the whole process group, not only its leader.
    _run(env, "start", "job", "bash", "-c", "sleep 60 & wait")
    pgid = int((tmp_path / "job.pgid").read_text())
    try:
        assert _wait_for(lambda: len(_states(pgid)) == 2)  # the shell and its sleep
        assert _autogroup(os.getpid()) == caller_group
        job_group = _autogroup(pgid)
        if job_group is not None:  # kernels without readable autogroups have nothing to lower
            assert job_group[1] == 19
            if caller_group is not None:
                assert job_group[0] != caller_group[0]
        assert f"job: process group {pgid}," in _run(env, "status").stdout

        refused = _run(env, "start", "job", "sleep", "1", check=False)
        assert refused.returncode != 0 and "already running" in refused.stderr
        assert int((tmp_path / "job.pgid").read_text()) == pgid

        _run(env, "pause")
        assert _wait_for(lambda: set(_states(pgid)) == {"T"})
        assert "(paused)" in _run(env, "status").stdout
        _run(env, "resume")
        assert _wait_for(lambda: "T" not in _states(pgid))
    finally:
        os.killpg(pgid, 9)
    assert _wait_for(lambda: "job:" not in _run(env, "status").stdout)


def test_a_job_without_a_command_is_refused(tmp_path):
    env = {**os.environ, "BACKGROUND_DIR": str(tmp_path)}
    result = _run(env, "start", "job", check=False)
    assert result.returncode == 2 and "usage" in result.stderr
    assert not (tmp_path / "job.pgid").exists()
    with pytest.raises(subprocess.CalledProcessError):
        _run(env, "bogus")
