"""`miles eval RUN_DIR --step N --submit` on the one-host Slurm dev cluster (`make slurm-up`): the
evaluation of a snapshot runs as a Slurm job of its own and leaves its result in the run directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles.config import resolve, write_plan
from miles.eval.snapshot import export_snapshot
from miles.launch.eval_job import submit_eval
from miles.launch.status import run_logs, run_status

FNS = Path(__file__).resolve().parents[1] / "e2e"


def _cluster_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm is not installed (see .ci/run)"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    idle = [s for s in out.stdout.split() if s in ("idle", "mixed", "allocated")]
    return None if out.returncode == 0 and idle else "dev cluster not up (make slurm-up)"


REASON = _cluster_up()
if REASON and os.environ.get("CI"):
    raise RuntimeError(f"CI needs the Slurm dev cluster: {REASON}")
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]


def _run_with_snapshot(tmp_path: Path, tiny_model: str, step: int, **eval_keys) -> Path:
    run_dir = tmp_path / "runs" / "evaljob"
    plan = resolve(
        {
            "run": {"name": "evaljob", "runs_root": str(tmp_path / "runs")},
            "model": {"path": tiny_model},
            "rollout": {"max_new_tokens": 4, "task": {"name": "digits", "eval_size": 4}},
            "eval": {"samples_per_prompt": 2, **eval_keys},
        }
    )
    write_plan(plan, run_dir / "plan.yaml")
    weights = sorted(load_file(str(next(Path(tiny_model).glob("*.safetensors")))).items())
    export_snapshot([weights], run_dir, step, tiny_model)
    return run_dir


def _wait_done(job_dir: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        state = run_status(job_dir)["state"]
        if state.startswith(("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")):
            return state
        time.sleep(1.0)
    raise AssertionError(f"{job_dir}: still {state} after {timeout_s}s\n{run_logs(job_dir)}")


def test_external_eval_as_its_own_job(tmp_path: Path, tiny_model: str, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(FNS))  # the job imports the function (sbatch passes the env on)
    run_dir = _run_with_snapshot(tmp_path, tiny_model, 4, mode="external", external_fn="e2e_eval_fns:quick")
    sub = submit_eval(run_dir, 4, profile="local")
    assert sub.job_id and Path(sub.script_path).read_text().startswith("#!/bin/bash")
    assert _wait_done(sub.job_dir) == "COMPLETED", run_logs(sub.job_dir, "eval")
    result = json.loads((run_dir / "eval" / "step_4" / "manual.json").read_text())
    assert result["step"] == 4 and result["metrics"]["eval/snapshot_step"] == 4.0
    assert "eval step exited with 0" in run_logs(sub.job_dir)


def test_dedicated_eval_as_its_own_job(tmp_path: Path, tiny_model: str) -> None:
    """The job starts an eval engine on its node, loads the snapshot as version 6 and evaluates."""
    run_dir = _run_with_snapshot(tmp_path, tiny_model, 6, mode="dedicated")
    sub = submit_eval(run_dir, 6, profile="local")
    assert _wait_done(sub.job_dir) == "COMPLETED", run_logs(sub.job_dir, "eval")
    metrics = json.loads((run_dir / "eval" / "step_6" / "manual.json").read_text())["metrics"]
    assert metrics["eval/weight_version_min"] == metrics["eval/weight_version_max"] == 6.0
    assert metrics["eval/mixed_version_ratio"] == 0.0 and metrics["eval/held_out/prompts"] == 4
    assert (run_dir / "logs" / "eval-engine-0.log").exists()
