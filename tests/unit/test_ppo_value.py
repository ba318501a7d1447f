"""PPO's value maths (miles/train/losses/value.py) against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config import ConfigError, resolve
from miles.train.losses import get_estimator
from miles.train.losses.value import (
    explained_variance,
    gae,
    ppo_targets,
    sample_gae,
    value_loss,
    variance_sums,
)


def _gae_by_hand(
    values: list[float], reward: float, gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """The textbook recursion over the trained tokens only, reward on the last one."""
    n = len(values)
    adv = [0.0] * n
    nxt_v, nxt_a = 0.0, 0.0
    for k in range(n - 1, -1, -1):
        r = reward if k == n - 1 else 0.0
        delta = r + gamma * nxt_v - values[k]
        adv[k] = delta + gamma * lam * nxt_a
        nxt_v, nxt_a = values[k], adv[k]
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def test_gae_lambda_one_gamma_one_is_reward_minus_value() -> None:
    values = torch.tensor([[0.5, 0.25, -1.0]])
    adv, ret = gae(values, torch.tensor([[0.0, 0.0, 2.0]]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([1.5, 1.75, 3.0])
    assert ret.tolist()[0] == pytest.approx([2.0, 2.0, 2.0])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.9), (0.9, 0.9), (0.9, 1.0)])
def test_gae_matches_the_recursion(gamma: float, lam: float) -> None:
    values = [0.3, -0.2, 0.7, 0.1]
    adv, ret = sample_gae([torch.tensor(values)], [torch.ones(4)], [1.0], gamma, lam)
    want_adv, want_ret = _gae_by_hand(values, 1.0, gamma, lam)
    assert adv[0].tolist() == pytest.approx(want_adv, abs=1e-6)
    assert ret[0].tolist() == pytest.approx(want_ret, abs=1e-6)
    # a worked number: gamma = lam = 0.9, last token: delta = 1 - 0.1 = 0.9
    if gamma == lam == 0.9:
        assert adv[0][-1].item() == pytest.approx(0.9)
        assert adv[0][-2].item() == pytest.approx((0.9 * 0.1 - 0.7) + 0.81 * 0.9)


def test_masked_tokens_are_skipped_not_zero_valued() -> None:
    """A tool's output between two turns (mask 0): GAE links the last token of turn 1 to the first of
    turn 2, as if the masked tokens were not there; masked tokens get advantage and return 0."""
    values = [0.3, -0.2, 9.0, 9.0, 0.7, 0.1]  # the 9s sit on masked tokens and must not count
    mask = [1, 1, 0, 0, 1, 1]
    adv, ret = sample_gae([torch.tensor(values)], [torch.tensor(mask)], [1.0], 0.9, 0.9)
    want_adv, want_ret = _gae_by_hand([0.3, -0.2, 0.7, 0.1], 1.0, 0.9, 0.9)
    got = adv[0].tolist()
    assert [got[i] for i in (0, 1, 4, 5)] == pytest.approx(want_adv, abs=1e-6)
    assert got[2] == got[3] == 0.0 and ret[0][2].item() == ret[0][3].item() == 0.0
    assert [ret[0].tolist()[i] for i in (0, 1, 4, 5)] == pytest.approx(want_ret, abs=1e-6)


def test_reward_sits_on_the_last_trained_token_and_rows_of_other_lengths_pad() -> None:
    adv, _ = sample_gae(
        [torch.zeros(3), torch.zeros(5)], [torch.tensor([1, 1, 0]), torch.ones(5)], [2.0, -1.0], 1.0, 0.0
    )
    # lam = 0: one-step TD errors; with V = 0 only the rewarded token has a non-zero advantage
    assert adv[0].tolist() == [0.0, 2.0, 0.0]
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0, -1.0]


def test_whitening_over_trained_tokens() -> None:
    values = {0: torch.zeros(3), 1: torch.zeros(2)}
    masks = {0: torch.tensor([1.0, 1.0, 0.0]), 1: torch.ones(2)}
    adv, ret = ppo_targets(values, masks, {0: 1.0, 1: 0.0}, 1.0, 1.0, True, lambda x: x)
    flat = torch.cat([adv[0][:2], adv[1]])
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert adv[0][2].item() == 0.0  # masked stays 0
    assert ret[0].tolist() == [1.0, 1.0, 0.0]  # returns are never whitened


def test_value_clipping_cases() -> None:
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ret = torch.tensor([1.0, 1.0, -1.0, 0.05])
    new = torch.tensor([0.5, 2.0, 0.5, 0.1])
    loss, clipped = value_loss(new, old, ret, clip=0.2)
    # 1: moved towards R beyond the clip: the clipped value 0.2 is further from R -> its loss 0.32
    # 2: overshoots R: unclipped (2-1)^2=1 vs clipped (0.2-1)^2=0.64 -> the larger, unclipped
    # 3: moved away from R: unclipped 2.25 vs clipped (0.2+1)^2=1.44 -> unclipped
    # 4: inside the clip: both equal, nothing clipped
    assert loss.tolist() == pytest.approx([0.5 * 0.64, 0.5 * 1.0, 0.5 * 2.25, 0.5 * 0.0025])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 0.0]
    unclipped, none = value_loss(new, old, ret, clip=None)
    assert unclipped[0].item() == pytest.approx(0.125) and none.sum().item() == 0.0


def test_explained_variance() -> None:
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.ones(4)
    assert explained_variance(variance_sums(ret, ret, mask)) == pytest.approx(1.0)
    assert explained_variance(variance_sums(ret, torch.full((4,), 2.5), mask)) == pytest.approx(0.0)
    assert explained_variance(variance_sums(ret, -ret, mask)) < 0
    # partial sums add up: two halves give the same as the whole
    halves = variance_sums(ret[:2], ret[:2] * 0.5, mask[:2]) + variance_sums(ret[2:], ret[2:] * 0.5, mask[2:])
    assert explained_variance(halves) == pytest.approx(
        explained_variance(variance_sums(ret, ret * 0.5, mask))
    )
    assert math.isnan(explained_variance(variance_sums(torch.ones(3), torch.zeros(3), torch.ones(3))))


def test_ppo_is_a_registered_estimator_with_a_critic_config() -> None:
    est = get_estimator("ppo")
    assert est.critic and not est.sequence_ratio
    plan = resolve({"train": {"loss": {"advantage": "ppo"}, "critic": {"lr": 1e-4, "warmup_steps": 2}}})
    assert plan.train.critic.lr == 1e-4 and plan.train.critic.value_clip == 0.2
    with pytest.raises(ConfigError, match="lam"):
        resolve({"train": {"critic": {"lam": 1.5}}})
