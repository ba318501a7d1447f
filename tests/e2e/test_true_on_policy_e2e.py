"""`miles train` with train.true_on_policy on a synchronous schedule (rollout and training on the same
weights, which the trainer pushes to the engine after every step): the engine runs deterministic
inference (its flags come from the key) and every step's train/logprob_mismatch is exactly 0.0, the
policy still learning (weights move, so steps 2 and 3 compare new weights on both sides). The same
run without the mode measures a mismatch above 0. A Qwen3-MoE run with routing replay: 0.0 too, and
the trainer's own router agrees with the rollout's choice everywhere."""

from __future__ import annotations

import pytest
from conftest import finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow


def _run(recipe, name: str, on: bool, steps: int) -> list[dict]:
    path, run_dir = recipe(
        run={"name": name},
        rollout={"max_new_tokens": 6, "schedule": "sync", "temperature": 0.9},
        train={"steps": steps, "true_on_policy": on, "loss": {"old_logprobs": "recompute"}},
    )
    finish(miles_train(path))
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("engine-*.log"))
    return [r for r in read_metrics(run_dir) if "train/logprob_mismatch" in r], logs


def test_the_mismatch_is_zero_with_the_mode_and_not_without(recipe) -> None:
    steps, _ = _run(recipe, "top-on", on=True, steps=3)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["train/logprob_mismatch"] for r in steps] == [0.0, 0.0, 0.0]
    assert any(r["train/grad_norm"] > 0 for r in steps)
    off, _ = _run(recipe, "top-off", on=False, steps=1)
    assert off[0]["train/logprob_mismatch"] > 0.0


def test_moe_with_routing_replay_is_bit_for_bit_too(recipe, tmp_path) -> None:
    from miles.models.tiny import init_tiny

    moe = init_tiny(tmp_path / "moe", arch="qwen3_moe", seed=0)
    path, run_dir = recipe(
        run={"name": "top-moe"},
        model={"path": str(moe)},
        rollout={"max_new_tokens": 6, "schedule": "sync"},
        train={"steps": 2, "true_on_policy": True, "routing_replay": "rollout"},
    )
    finish(miles_train(path))
    steps = [r for r in read_metrics(run_dir) if "train/logprob_mismatch" in r]
    assert [r["train/logprob_mismatch"] for r in steps] == [0.0, 0.0]
    assert all(r["train/router_agreement"] == 1.0 for r in steps)
    assert all(r["train/router_natural_agreement"] == 1.0 for r in steps)  # the same router numerics
