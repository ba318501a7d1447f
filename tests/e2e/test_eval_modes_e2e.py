"""The three evaluation modes in whole `miles train` runs on CPU (tiny model, real engines, real
trainer): each result in the record of the step whose weights produced it; dedicated and external
results arrive after training moved on (lag > 0) without holding it; a failing external evaluation
is skipped and counted; every evaluated token came from the evaluated step's weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow


def _records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir)}


def _train_steps(records: dict[int, dict]) -> list[int]:
    return sorted(s for s, r in records.items() if "train/loss" in r)


def test_shared_mode_pauses_the_async_producer_and_logs_at_once(recipe) -> None:
    path, run_dir = recipe(
        rollout={"schedule": "async"},
        train={"steps": 4},
        eval={"mode": "shared", "every_steps": 2, "samples_per_prompt": 2},
    )
    finish(miles_train(str(path)), timeout_s=400)
    records = _records(run_dir)
    assert _train_steps(records) == [1, 2, 3, 4]
    evals = {s: r for s, r in records.items() if "eval/pass@1" in r}
    assert sorted(evals) == [0, 2, 4]
    for step, r in evals.items():
        assert r["eval/lag_steps"] == 0 and r["eval/mixed_version_ratio"] == 0
        assert r["eval/weight_version_min"] == r["eval/weight_version_max"] == step
    assert not (run_dir / "eval" / "snapshots").exists()  # shared mode exports nothing
    # by hand, as the README shows: a step with a checkpoint is exported, then evaluated
    out = subprocess.run([sys.executable, "-m", "miles.cli", "eval", str(run_dir), "--step", "4"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pass@1" in out.stdout and (run_dir / "eval" / "snapshots" / "step_4" / ".complete").is_file()
    missing = subprocess.run([sys.executable, "-m", "miles.cli", "eval", str(run_dir), "--step", "3"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode == 1 and "steps that can be evaluated: 4" in missing.stderr, missing.stderr


def test_dedicated_mode_evaluates_snapshots_while_training_goes_on(recipe) -> None:
    path, run_dir = recipe(
        rollout={"schedule": "async", "reward": "e2e_eval_fns:late_eval_reward"},
        train={"steps": 6},
        eval={"mode": "dedicated", "every_steps": 2, "samples_per_prompt": 2, "keep_snapshots": 1},
    )
    finish(miles_train(str(path)), timeout_s=500)
    records = _records(run_dir)
    assert _train_steps(records) == [1, 2, 3, 4, 5, 6]
    evals = {s: r for s, r in records.items() if "eval/pass@1" in r}
    assert sorted(evals) == [0, 2, 4, 6]
    for step, r in evals.items():
        assert r["eval/weight_version_min"] == r["eval/weight_version_max"] == step  # the snapshot's
        assert r["eval/mixed_version_ratio"] == 0.0
        assert r["eval/export_s"] > 0 and r["eval/duration_s"] > 0
        assert r["eval/lag_steps"] >= (1 if step < 6 else 0)  # training went on meanwhile
    assert (run_dir / "logs" / "eval-engine-0.log").exists()
    kept = sorted(p.name for p in (run_dir / "eval" / "snapshots").iterdir())
    assert kept == ["step_6"]  # eval.keep_snapshots=1
    assert (run_dir / "eval" / "held_out" / "step_4.jsonl").exists()  # per-sample records


def test_external_mode_failures_are_skipped_and_counted(recipe) -> None:
    path, run_dir = recipe(
        rollout={"schedule": "sync"},
        train={"steps": 4},
        eval={
            "mode": "external",
            "external_fn": "e2e_eval_fns:stats_or_fail_at_odd_steps",
            "every_steps": 1,
            "max_in_flight": 2,
        },
    )
    finish(miles_train(str(path)), timeout_s=400)
    records = _records(run_dir)
    assert _train_steps(records) == [1, 2, 3, 4]  # failed evaluations never stopped training
    assert records[1]["eval/skipped_error"] == 1.0 and records[3]["eval/skipped_error"] == 2.0
    for step in (0, 2, 4):
        r = records[step]
        assert r["eval/snapshot_step"] == step and r["eval/params"] > 0
        assert r["eval/lag_steps"] >= (1 if step < 4 else 0)
        assert "eval/skipped_error" not in r
    assert "odd step" in (run_dir / "eval" / "step_3" / "external.log").read_text()
