"""On the one-host Slurm dev cluster (`make slurm-up`): `eval.mode: dedicated` as a third het group.

The job holds a rollout node (embedded engine), two actor nodes (gloo trainer ranks running the RL
loop) and one eval node whose engine the trainer's eval runner finds in
RUN_DIR/rendezvous/eval_engines/ and loads each snapshot into. The eval results land in
metrics.jsonl at the steps whose weights produced them; the eval engine is then killed, and the job
still completes: the batch script reports the eval step's end and goes on, the loop counts the
evaluations it could not run as skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from miles.cluster.rendezvous import EVAL_ENGINES, read_engines
from miles.launch.status import run_logs, run_status
from miles.launch.submit import submit
from miles.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "slurm-tiny.yaml")
STEPS = 10


def _cluster_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm is not installed (see .ci/run)"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    usable = [s for s in out.stdout.split() if s in ("idle", "mixed", "allocated")]
    return (
        None if out.returncode == 0 and len(usable) >= 4 else "dev cluster of 4 nodes not up (make slurm-up)"
    )


REASON = _cluster_up()
if REASON and os.environ.get("CI"):
    raise RuntimeError(f"CI needs the Slurm dev cluster: {REASON}")
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]


def _wait_for(what: str, ready, run_dir: Path, timeout_s: float) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := ready()):
        state = run_status(str(run_dir))["state"]
        if time.monotonic() > deadline or state.startswith(("COMPLETED", "FAILED", "CANCELLED")):
            raise AssertionError(f"{run_dir}: no {what} (job {state})\n{run_logs(run_dir)}")
        time.sleep(1.0)
    return value


def _evaluated(run_dir: Path) -> dict[int, dict]:
    if not (run_dir / "metrics.jsonl").exists():
        return {}
    return {r["step"]: r for r in read_metrics(run_dir) if "eval/pass@1" in r}


def test_eval_group_evaluates_and_its_loss_does_not_fail_the_job(tmp_path: Path, tiny_model: str) -> None:
    sets = [
        f"run.runs_root={tmp_path}",
        f"model.path={tiny_model}",
        f"train.steps={STEPS}",
        "eval.mode=dedicated",
        "eval.every_steps=2",
        "eval.samples_per_prompt=2",
        # one evaluation at a time, training waits for it: the kill below lands before the last one
        "eval.max_in_flight=1",
        "eval.overflow=wait",
    ]
    sub = submit(TINY, "local", sets)
    run_dir, incarnation = Path(sub.run_dirs[0]), f"{sub.job_ids[0]}.0"
    script = (run_dir / "submission.sh").read_text()
    assert script.count("#SBATCH hetjob") == 2 and "miles.cluster.bootstrap eval" in script

    engines = _wait_for("eval engine", lambda: read_engines(run_dir, incarnation, EVAL_ENGINES), run_dir, 180)
    _wait_for("evaluation result", lambda: _evaluated(run_dir), run_dir, 240)
    os.kill(engines[0]["pid"], signal.SIGKILL)  # the eval group loses its only engine

    deadline = time.monotonic() + 400
    while not (state := run_status(str(run_dir))["state"]).startswith(("COMPLETED", "FAILED", "CANCELLED")):
        assert time.monotonic() < deadline, run_logs(run_dir)
        time.sleep(1.0)
    logs = run_logs(run_dir)
    assert state == "COMPLETED", logs
    assert "miles: eval step ended; the job goes on without it" in logs, logs

    records = read_metrics(run_dir)
    assert sorted(r["step"] for r in records if "train/loss" in r) == list(range(1, STEPS + 1))
    evaluated = _evaluated(run_dir)
    assert evaluated and set(evaluated) <= set(range(0, STEPS + 1, 2))
    for step, r in evaluated.items():
        # logged at the step whose snapshot was evaluated, every token from that step's weights
        assert r["eval/weight_version_min"] == r["eval/weight_version_max"] == step
        assert r["eval/mixed_version_ratio"] == 0.0 and r["eval/lag_steps"] >= 0
    skipped = {k: v for r in records for k, v in r.items() if k.startswith("eval/skipped_")}
    assert skipped and max(skipped.values()) >= 1, records
    # the engines were the eval group's (published from its node), none started beside the trainer
    node = engines[0]["node"]
    assert (run_dir / "logs" / f"eval-engine-{node}-0.log").exists()
    assert not (run_dir / "logs" / "eval-engine-0.log").exists()
    assert json.loads((run_dir / "launch.json").read_text())["eval_nodes"] == 1
