"""A hung NCCL collective: the watchdog fires within train.collective_timeout_s, the job exits
non-zero, and the flight-recorder dump lands in the run's logs directory. Needs 2 CUDA GPUs.

Two NCCL ranks under torchrun run tests/integration/collective_stall.py with the collectives
environment Miles exports on GPU profiles (miles.cluster.collectives): rank 1 stops taking part,
rank 0 waits in the synchronisation until the watchdog times its all-reduce out, dumps the flight
recorder to RUN_DIR/logs/flight_recorder-0 and aborts the rank; torchrun then ends rank 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.cluster.collectives import collectives_env
from miles.config import write_plan
from miles.config.profile import load_profile
from miles.launch.submit import load_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu2,  # NCCL refuses two ranks on one GPU
]

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "slurm-tiny.yaml")


def test_hung_nccl_collective_dumps_the_flight_recorder_into_the_run_logs(tmp_path: Path) -> None:
    plan, _ = load_plan(TINY, "local", [f"run.runs_root={tmp_path}", "train.collective_timeout_s=10"])
    run_dir = Path(plan.run_dir)
    (run_dir / "logs").mkdir(parents=True)
    write_plan(plan, run_dir / "plan.yaml")
    env = {**os.environ, **collectives_env(load_profile("h200"), str(run_dir / "logs"))}
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env.update(PYTHONPATH=path, NCCL_SOCKET_IFNAME="lo", NCCL_IB_HCA="", CUDA_VISIBLE_DEVICES="0,1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "tests.integration.collective_stall", "--run-dir", str(run_dir), "--device", "cuda"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "rank 1: stops participating" in text, text[-3000:]
    dumps = sorted(p.name for p in (run_dir / "logs").glob("flight_recorder-*"))
    assert "flight_recorder-0" in dumps, (dumps, text[-3000:])
    assert (run_dir / "logs" / "flight_recorder-0").stat().st_size > 0
