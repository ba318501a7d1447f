"""`miles train --resume` refuses before starting anything when no checkpoint of the run verifies."""

from __future__ import annotations

import json
from pathlib import Path

from miles.cli import main
from miles.config import resolve, write_plan

REPO = Path(__file__).resolve().parents[2]


def _earlier_run(tmp_path: Path, tiny_model: str) -> Path:
    plan = resolve(
        str(REPO / "recipes" / "default.yaml"), [f"run.runs_root={tmp_path}", f"model.path={tiny_model}"]
    )
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True)
    write_plan(plan, run_dir / "plan.yaml")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.0}) + "\n")
    return run_dir


def test_resume_without_a_checkpoint_is_refused_with_what_to_do(tmp_path, tiny_model, capsys) -> None:
    run_dir = _earlier_run(tmp_path, tiny_model)
    assert main(["train", str(REPO / "recipes" / "default.yaml"), "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint verifies" in err and "start without --resume" in err
    assert not (run_dir / "logs").exists()  # nothing was started


def test_resume_reports_a_damaged_checkpoint_then_refuses_when_none_is_left(tmp_path, tiny_model, capsys):
    run_dir = _earlier_run(tmp_path, tiny_model)
    step = run_dir / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"x" * 10)
    (step / ".complete").write_text(
        json.dumps({"format": 2, "step": 5, "hash": "sha256", "files": {"model.pt": [100, "0" * 64]}})
    )
    assert main(["train", str(REPO / "recipes" / "default.yaml"), "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "step 5" in err and str(step) in err and "no complete checkpoint verifies" in err
