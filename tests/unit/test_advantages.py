"""Advantage estimators against hand-computed values, and the estimator registry."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config.train import LossConfig
from miles.train.losses import ADVANTAGE_ESTIMATORS, get_estimator
from miles.train.losses.advantages import grpo_advantages, reinforce_pp_advantages

T = torch.tensor


def test_grpo_group_normalised() -> None:
    rewards = T([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = T([0, 0, 0, 1, 1, 1])
    counts = torch.ones(6)
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0)
    adv = grpo_advantages(rewards, groups, counts, normalize_std=True)
    assert adv.tolist() == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0, 0, 0], rel=1e-5)
    plain = grpo_advantages(rewards, groups, counts, normalize_std=False)
    assert plain.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_grpo_groups_by_id_not_position_and_single_sample_groups() -> None:
    adv = grpo_advantages(T([2.0, 5.0, 4.0, 1.0, 9.0]), T([7, 3, 7, 3, 11]), torch.ones(5), False)
    assert adv.tolist() == pytest.approx([-1.0, 2.0, 1.0, -2.0, 0.0])
    assert grpo_advantages(T([3.0]), T([0]), T([1.0]), True).tolist() == [0.0]


def test_reinforce_pp_baseline_then_token_weighted_whitening() -> None:
    rewards = T([1.0, 0.0, 1.0, 1.0])
    groups = T([0, 0, 1, 1])
    counts = T([1.0, 3.0, 2.0, 2.0])
    # a = (0.5, -0.5, 0, 0); mu = -1/8; sigma^2 = 0.875 / 8
    sigma = math.sqrt(0.875 / 8)
    expected = [0.625 / sigma, -0.375 / sigma, 0.125 / sigma, 0.125 / sigma]
    assert reinforce_pp_advantages(rewards, groups, counts).tolist() == pytest.approx(expected, rel=1e-5)


def test_registry() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "reinforce_pp", "gspo", "ppo"}
    assert get_estimator("gspo").sequence_ratio and not get_estimator("grpo").sequence_ratio
    r, g, c = T([1.0, 0.0]), T([0, 0]), T([1.0, 1.0])
    cfg = LossConfig()
    assert (
        get_estimator("gspo").compute(r, g, c, cfg).tolist()
        == get_estimator("grpo").compute(r, g, c, cfg).tolist()
    )
    assert get_estimator("ppo").critic and get_estimator("ppo").compute(r, g, c, cfg).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="known: grpo, gspo, ppo, reinforce_pp"):
        get_estimator("a2c")


def test_trajectory_weights_count_episodes_not_trajectories() -> None:
    """Episode A (one trajectory, reward 1) and episode B (five trajectories of weight 1/5, reward 0)
    have the advantages of a plain group of two samples (1, 0)."""
    rewards = T([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    groups = T([0] * 6)
    weights = T([1.0] + [0.2] * 5)
    adv = grpo_advantages(rewards, groups, torch.ones(6), True, weights)
    plain = grpo_advantages(T([1.0, 0.0]), T([0, 0]), torch.ones(2), True)
    assert adv.tolist() == pytest.approx([plain[0].item()] + [plain[1].item()] * 5, rel=1e-6)
    rpp = reinforce_pp_advantages(rewards, groups, torch.ones(6), weights)
    rpp_plain = reinforce_pp_advantages(T([1.0, 0.0]), T([0, 0]), torch.ones(2))
    assert rpp.tolist() == pytest.approx([rpp_plain[0].item()] + [rpp_plain[1].item()] * 5, rel=1e-6)
    # weights of 1 change nothing
    assert torch.equal(grpo_advantages(rewards, groups, torch.ones(6), True, torch.ones(6)),
                       grpo_advantages(rewards, groups, torch.ones(6), True))  # fmt: skip
