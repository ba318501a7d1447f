"""A rank that stops taking part in a collective fails the job within the configured timeout.

Real gloo ranks on loopback under torchrun run tests/integration/collective_stall.py: the process
group is made by miles.cluster.distributed with `train.collective_timeout_s` from the plan. The
waiting rank's collective must time out with that timeout (gloo names it in its error), the rank
exits non-zero, and torchrun ends the stalled rank and the job. The subprocess limit is far below
the 600 s default, so a timeout that was not applied shows up as a hang, i.e. a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.config import write_plan
from miles.launch.submit import load_plan

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "slurm-tiny.yaml")


def test_stalled_rank_times_out_the_collective_and_fails_the_job(tmp_path: Path) -> None:
    timeout_s = 3
    plan, _ = load_plan(
        TINY, "local", [f"run.runs_root={tmp_path}", f"train.collective_timeout_s={timeout_s}"]
    )
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True)
    write_plan(plan, run_dir / "plan.yaml")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "tests.integration.collective_stall", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "rank 1: stops participating" in text and "completed without the stalled rank" not in text
    assert f"Timed out waiting {timeout_s * 1000}ms" in text, text[-3000:]
