"""`miles train --resume` after a SIGKILL and a damaged newest checkpoint, end to end on CPU: the run
continues from the previous complete checkpoint, says so naming both steps and the path, and records
every step (and every evaluation) once."""

from __future__ import annotations

import pytest
from conftest import finish, miles_train, stop, wait_for_step, wait_gone

from miles.metrics import read_metrics
from miles.train.checkpoint import complete_steps, step_dir

pytestmark = pytest.mark.slow


def test_resume_after_kill_skips_a_truncated_newest_checkpoint(recipe) -> None:
    path, run_dir = recipe(
        # far more steps than the run can take between seeing step 5 and the kill
        train={"steps": 1000, "checkpoint": {"every_steps": 2, "keep_last": 2}},
        rollout={"schedule": "async"},
        eval={"every_steps": 3, "samples_per_prompt": 1},
    )
    proc = miles_train(str(path))
    try:
        wait_for_step(run_dir, 5, proc)
        proc.kill()  # SIGKILL: no final checkpoint; every child dies with the launcher
        proc.wait()
    finally:
        stop(proc)
    # nothing may write a checkpoint any more before the newest one is read and damaged
    assert wait_gone(run_dir) == [], "a process of the killed run is still alive"
    before = [r["step"] for r in read_metrics(run_dir)]
    assert before[:6] == [0, 1, 2, 3, 4, 5], before
    *_, previous, newest = complete_steps(run_dir)  # e.g. [2, 4] or [4, 6] (keep_last=2)
    assert previous == newest - 2 and newest <= max(before), (complete_steps(run_dir), before)
    damaged = step_dir(run_dir, newest)
    shard = max((p for p in (damaged / "state").iterdir()), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:1000])

    end = newest + 2
    finish(miles_train(str(path), "--resume", str(run_dir), "--set", f"train.steps={end}"))
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f"checkpoint step {newest} at {damaged} is damaged (state/{shard.name} has 1000 bytes" in log
    assert f"resuming from step {previous}" in log and f"resumed from checkpoint step {previous}" in log
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(end + 1))  # nothing lost, nothing twice
    evals = sorted({*range(0, end + 1, 3), end})
    assert [r["step"] for r in records if "eval/pass@1" in r] == evals
    assert complete_steps(run_dir) == [newest, end]  # written again after the resume
