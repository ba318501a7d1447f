"""The coding recipe on a mix of generated tasks and a real one: a Terminal-Bench 1 task written
elsewhere (tests/foreign_tasks/tb1-count-errors), converted by `miles tasks convert`, then `miles
train recipes/coding-tiny.yaml` with rollout.env.options.tasks naming it beside generate: true. About
half of the training episodes play generated tasks and half the converted one (agent/generated), held-out
episodes play the converted task, no sample is masked, and the run ends with its checkpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import finish, miles_train

from miles.metrics import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]
REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_coding_recipe_trains_on_generated_and_converted_tasks(tmp_path) -> None:
    real = tmp_path / "real"
    conv = subprocess.run(
        [sys.executable, "-m", "miles", "tasks", "convert", str(REPO / "tests" / "foreign_tasks" / "tb1-count-errors"),
         "--out", str(real)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert conv.returncode == 0, conv.stdout + conv.stderr
    overrides = [
        f"run.runs_root={tmp_path / 'runs'}", "run.tensorboard=false", f"model.path={tmp_path / 'model'}",
        "model.tiny.pretrain_steps=0", f"rollout.env.options.tasks={real}", "rollout.env.options.generate_share=0.5",
        "rollout.env.options.internet=off", f"train.steps={STEPS}", "train.checkpoint.every_steps=0",
        "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2", "rollout.task.eval_size=2",
        "eval.every_steps=3",
    ]  # fmt: skip
    sets = [x for o in overrides for x in ("--set", o)]
    finish(miles_train(REPO / "recipes" / "coding-tiny.yaml", *sets), timeout_s=900)
    rows = [r for r in read_metrics(tmp_path / "runs" / "coding-tiny") if r["step"] > 0]
    trained = [r for r in rows if "agent/generated" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1)), rows
    # a step trains the episodes that finished first (an asynchronous rollout), so one step may hold
    # one kind only; over the run both kinds train, about half each
    shares = [r["agent/generated"] for r in trained]
    assert min(shares) < 1.0 and max(shares) > 0.0 and abs(sum(shares) / len(shares) - 0.5) <= 0.25, shares
    assert all(r.get("rollout/masked_samples", 0) == 0 for r in trained)
    held_out = [r for r in rows if "eval/held_out/pass@1" in r or "eval/pass@1" in r]
    assert held_out, rows
