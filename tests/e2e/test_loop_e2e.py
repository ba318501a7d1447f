"""End-to-end runs of `miles train` on CPU: real engine(s), router, trainer, weight sync, metrics.

Each test starts the whole job as a child process, like a user would, and asserts on what the run
left in its run directory (metrics.jsonl, checkpoints, logs).
"""

from __future__ import annotations

import pytest
import yaml
from conftest import finish, miles_train, steps_of, stop, wait_for_step

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_reward_rises(recipe) -> None:
    path, run_dir = recipe(
        rollout={
            "prompts_per_step": 8,
            "n_samples_per_prompt": 8,
            "schedule": "sync",
            "reward": "e2e_rewards:has_digit",
        },
        train={"steps": 30, "lr": 3e-3},
        eval={"every_steps": 15, "samples_per_prompt": 2},
    )
    finish(miles_train(str(path)), timeout_s=280)
    records = read_metrics(run_dir)
    rewards = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.2, rewards
    evals = [r for r in records if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert all(r["eval/weight_version_min"] == r["eval/weight_version_max"] == r["step"] for r in evals)
    assert (run_dir / "checkpoints" / "step_30" / ".complete").exists()


@pytest.mark.parametrize("mode", ["in_place", "abort"])
def test_pause_modes(recipe, mode: str) -> None:
    # long responses (the random model rarely stops): generating a sample takes longer than a training
    # step, so requests are in flight at every weight push whatever the machine's speed
    steps = 6
    path, run_dir = recipe(
        rollout={"schedule": "async", "max_new_tokens": 160, "max_staleness": 4},
        train={"steps": steps},
        weights={"check": True, "pause_mode": mode},
    )
    finish(miles_train(str(path)))
    records = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert len(records) == steps
    assert all(r["weights/check_max_diff"] == 0.0 for r in records)
    multi = [r["rollout/multi_version_frac"] for r in records]
    resent = [r["rollout/resent_frac"] for r in records]
    if mode == "in_place":
        assert max(multi) > 0, multi  # samples continued across an update carry two versions
    else:
        assert max(multi) == 0 and max(resent) > 0, (multi, resent)  # aborted, then sent again


def test_two_engines_behind_router(recipe) -> None:
    path, run_dir = recipe(
        engine={"num_engines": 2, "router_policy": "round_robin"},
        rollout={"prompts_per_step": 4, "n_samples_per_prompt": 4, "group_requests": True},
        eval={"every_steps": 3, "samples_per_prompt": 2},
        train={"steps": 3},
        weights={"check": True, "transport": "disk"},
    )
    finish(miles_train(str(path)))
    last = read_metrics(run_dir)[-1]
    assert (
        last["step"] == 3 and last["weights/check_max_diff"] == 0.0 and last["eval/weight_version_min"] == 3
    )
    assert last["engine/0/num_steps"] > 0 and last["engine/1/num_steps"] > 0
    assert (run_dir / "logs" / "router.log").exists()


def test_preempt_file_checkpoints_exits_and_resumes(recipe) -> None:
    # far more steps than the run can take before the file is seen, however fast the machine
    path, run_dir = recipe(train={"steps": 1000}, rollout={"schedule": "async"})
    proc = miles_train(str(path))
    try:
        wait_for_step(run_dir, 2, proc)
        (run_dir / "control").mkdir(exist_ok=True)
        (run_dir / "control" / "preempt").touch()
        finish(proc, timeout_s=120)  # exit code 0: a preempted run is not a failure
    finally:
        stop(proc)
    stopped_at = steps_of(run_dir)[-1]
    assert stopped_at >= 2 and (run_dir / "checkpoints" / f"step_{stopped_at}" / ".complete").exists()
    # continue on two trainer ranks for two more steps: the checkpoint reshards, rank 0 feeds both
    end = stopped_at + 2
    finish(
        miles_train(
            str(path), "--resume", str(run_dir), "--set", "train.num_ranks=2", "--set", f"train.steps={end}"
        )
    )
    assert steps_of(run_dir) == list(range(1, end + 1))
    assert not (run_dir / "control" / "preempt").exists()
    assert "resumed from checkpoint" in (run_dir / "logs" / "trainer-1.log").read_text()


@pytest.mark.parametrize(("schedule", "release"), [("sync", True), ("sync", False), ("async", True)])
def test_colocated_run_hands_weights_by_reference(recipe, schedule: str, release: bool) -> None:
    """launch.layout=colocated: the derived tensor transport (shared memory on CPU) delivers exact
    weights; with the sync schedule the engine is released and resumed around every training step
    (unless engine.release_memory_in_train is off), with async it stays resident and generates while
    the trainer trains."""
    path, run_dir = recipe(
        launch={"layout": "colocated"},
        engine={"release_memory_in_train": release},
        rollout={"schedule": schedule},
        train={"steps": 3},
        weights={"check": True},
    )
    data = yaml.safe_load(path.read_text())
    del data["weights"]["transport"]  # left to the layout to derive
    options = {"prompt_tokens": 12, "response_tokens": 5, "high": 50}
    data["rollout"]["task"] = {"name": "random_tokens", "options": options, "eval_size": 2}
    path.write_text(yaml.safe_dump(data))
    finish(miles_train(str(path)))
    records = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["weights/check_max_diff"] == 0.0 for r in records)
    assert all(r["rollout/response_len_mean"] == 5 for r in records)  # ignore_eos, exact length
    if schedule == "sync" and release:
        assert all(r["time/engine_release_s"] > 0 and r["time/engine_resume_s"] > 0 for r in records)
    else:
        assert not any("time/engine_release_s" in r for r in records)
    plan = (run_dir / "plan.yaml").read_text()
    assert "transport: tensor" in plan
