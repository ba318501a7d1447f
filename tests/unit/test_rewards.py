"""Reward functions: exact match, first number, math-verify in a process pool, reasoning-gym, loading."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.rollout import rewards
from miles.sample import Sample


def sample(response: str, answer, **metadata) -> Sample:
    return Sample(0, 0, [1], response=response, answer=answer, metadata=metadata)


def test_exact_match() -> None:
    assert rewards.exact_match(sample(" 42 ", "42")) == 1.0
    assert rewards.exact_match(sample("so \\boxed{7}", 7)) == 1.0
    assert rewards.exact_match(sample("42x", "42")) == 0.0


def test_first_number() -> None:
    assert rewards.first_number(sample("5abc", "5")) == 1.0
    assert rewards.first_number(sample("x 55", "5")) == 0.0
    assert rewards.first_number(sample("none", "5")) == 0.0


@pytest.mark.slow
def test_math_verify_in_process_pool() -> None:
    assert rewards.math_verify(sample("\\boxed{\\frac{1}{2}}", "0.5")) == 1.0
    assert rewards.math_verify(sample("\\boxed{3}", "0.5")) == 0.0


def test_reasoning_gym_scoring() -> None:
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=1)[0]
    assert rewards.reasoning_gym(sample(str(entry["answer"]), entry["answer"], entry=entry)) == 1.0
    assert rewards.reasoning_gym(sample("nonsense", entry["answer"], entry=entry)) < 1.0


def test_load_reward_builtin_and_dotted() -> None:
    assert rewards.load_reward("exact_match") is rewards.exact_match
    assert rewards.load_reward("miles.rollout.rewards:first_number") is rewards.first_number


@pytest.mark.parametrize("spec", ["no_colon", "miles.nope:fn", "miles.rollout.rewards:missing"])
def test_load_reward_errors_name_the_key(spec: str) -> None:
    with pytest.raises(ConfigError, match="rollout.reward"):
        rewards.load_reward(spec)


@pytest.mark.slow
def test_math_verify_timeout_scores_zero_and_pool_recovers() -> None:
    pool = rewards.VerifyPool(timeout_s=1e-4)
    try:
        assert pool.verify("$1$", "$1$") is False  # cannot finish in 0.1 ms: the stuck pool is replaced
        pool.timeout_s = 30.0
        assert pool.verify("$1$", "$1$") is True
    finally:
        pool.close()
