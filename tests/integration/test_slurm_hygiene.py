"""Job hygiene on the one-host Slurm dev cluster (`make slurm-up`): a submission from a fresh clone
prepares what it needs and completes, and a rollout component that fails at start ends the job at
once with the component named. (That every process runs the intra-op threads its allocation gives it
is checked on the RL-loop job of test_slurm_cluster.py.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm_cluster import REASON, REPO, SELFTEST, TINY, _wait

from miles.launch.status import format_table, run_logs, run_status
from miles.launch.submit import submit

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]
DONE = ("COMPLETED", "FAILED", "CANCELLED")


def test_submission_from_a_fresh_clone_completes(tmp_path: Path) -> None:
    """`git clone` + `miles submit` with no model prepared: the submit host creates the tiny model
    (the job's steps only read it) and the job, running the clone's code, completes."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    assert not (clone / "runs").exists()
    env = {**os.environ, "PYTHONPATH": str(clone)}  # the clone's code, on the submit host and in the job
    sets = [f"run.runs_root={tmp_path / 'runs'}", "train.steps=1"]
    out = subprocess.run(
        [sys.executable, "-m", "miles", "submit", "recipes/slurm-tiny.yaml", "--profile", "local"]
        + [a for s in sets for a in ("--set", s)],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "creating a tiny random model" in out.stderr
    run_dir = tmp_path / "runs" / "slurm-tiny"
    assert f"for {run_dir}" in out.stdout, out.stdout
    assert (clone / "runs" / "models" / "tiny" / "config.json").exists()
    assert _wait(str(run_dir), DONE, 240) == "COMPLETED", run_logs(run_dir, "actor")
    assert (run_dir / "checkpoints" / "step_1" / ".complete").exists()


def _broken_model(tiny_model: str, where: Path) -> Path:
    broken = where / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen2", "hidden_size": ')  # cut off mid-write
    return broken


def test_rollout_failing_at_start_fails_the_job_within_a_minute(tmp_path: Path, tiny_model: str) -> None:
    """The engine cannot load its model: the rollout step ends, the batch script stops the actor step
    (waiting for engines that will never come) and the job is FAILED within 60 s of submission;
    `miles status` and `miles logs` name the rollout component and show the end of its error."""
    broken = _broken_model(tiny_model, tmp_path)
    sets = [f"run.runs_root={tmp_path}", f"model.path={broken}", "model.init_tiny_if_missing=false", SELFTEST]
    run_dir = submit(TINY, "local", sets).run_dirs[0]
    assert _wait(run_dir, DONE, 60) == "FAILED"
    fail = run_status(run_dir)["failure"]
    assert fail["role"] == "rollout" and re.search(r"/logs/engine-n\d+-0\.log$", fail["log"]), fail
    assert "JSONDecodeError: Expecting value" in fail["error"].splitlines()[-1], fail
    table = format_table([run_status(run_dir)])
    assert "the rollout step failed" in table and "JSONDecodeError" in table
    logs = run_logs(run_dir)
    assert "miles: rollout step exited with 1 before the actor step; stopping the job" in logs
    # the batch log itself ends with the failed step's last lines, naming the engine and its log
    assert re.search(r"\| miles bootstrap: engine 0 on n\d+ exited with 1 before serving; see ", logs), logs
    assert "the rollout step failed" in logs and "JSONDecodeError" in logs
    assert not (Path(run_dir) / "selftest.json").exists()  # the actor never got past the engines
