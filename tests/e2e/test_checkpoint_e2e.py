"""`miles train --resume` over a damaged newest checkpoint, end to end on CPU: the run continues from
the previous checkpoint, says so naming both steps and the path, and records every step once."""

from __future__ import annotations

import pytest
from conftest import finish, miles_train

from miles.metrics import read_metrics
from miles.train.checkpoint import complete_steps, step_dir

pytestmark = pytest.mark.slow


def test_resume_skips_a_truncated_newest_checkpoint(recipe) -> None:
    path, run_dir = recipe(
        train={"steps": 6, "checkpoint": {"every_steps": 2, "keep_last": 2}},
        eval={"every_steps": 3, "samples_per_prompt": 1},
    )
    finish(miles_train(str(path)))
    assert complete_steps(run_dir) == [4, 6]
    newest = step_dir(run_dir, 6)
    shard = max((p for p in (newest / "state").iterdir()), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:1000])

    finish(miles_train(str(path), "--resume", str(run_dir), "--set", "train.steps=8"))
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f"checkpoint step 6 at {newest} is damaged (state/{shard.name} has 1000 bytes" in log
    assert "resuming from step 4" in log and "resumed from checkpoint step 4" in log
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(9))
    assert [r["step"] for r in records if "eval/pass@1" in r] == [0, 3, 6, 8]
    assert complete_steps(run_dir) == [6, 8]  # step 6 written again after the resume from 4
