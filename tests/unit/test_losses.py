"""RL objectives against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config.train import LossConfig
from miles.train.losses import (
    aggregate,
    entropy_from_logits,
    kl_estimate,
    kl_penalty,
    ppo_clip_loss,
    sequence_log_ratio,
    tis_weights,
    token_weights,
)
from miles.train.objective import TokenBatch, policy_objective

T = torch.tensor


def test_ppo_clip_low_high_and_clip_fraction() -> None:
    ratio = T([0.5, 1.0, 1.5, 1.5, 0.5, 1.25])
    adv = T([1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
    loss, clipped = ppo_clip_loss(ratio.log(), adv, eps_clip=0.2, eps_clip_high=0.28)
    # A>0: max(-r, -clip(r)); r=1.5 is capped at 1.28, r=1.25 is inside the clip-higher band
    assert loss.tolist() == pytest.approx([-0.5, -1.0, -1.28, 1.5, 0.8, -1.25])
    assert clipped.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    symmetric, _ = ppo_clip_loss(ratio.log(), adv, eps_clip=0.2, eps_clip_high=0.2)
    assert symmetric[5].item() == pytest.approx(-1.2)


def test_dual_clip_bounds_negative_advantages() -> None:
    ratio = T([4.0, 4.0, 1.1])
    adv = T([-1.0, 1.0, -2.0])
    loss, clipped = ppo_clip_loss(ratio.log(), adv, 0.2, 0.2, dual_clip=3.0)
    # A=-1, r=4: PPO gives 4, dual clip caps at c*|A| = 3; A>0 untouched; small ratio untouched
    assert loss.tolist() == pytest.approx([3.0, -1.2, 2.2])
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(ratio.log(), adv, 0.2, 0.2, dual_clip=0.5)


def test_gspo_sequence_ratio_is_masked_mean() -> None:
    log_ratio = T([0.1, 0.3, -0.2, 0.5])
    mask = T([1.0, 1.0, 0.0, 1.0])
    seq = T([0, 0, 0, 1])
    out = sequence_log_ratio(log_ratio, mask, seq, 2)
    assert out.tolist() == pytest.approx([0.2, 0.2, 0.2, 0.5])


def test_kl_estimators() -> None:
    logp, ref = T([-1.0, -2.0]), T([-1.5, -2.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, 0.0])
    assert (kl_estimate(ref, logp, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, ref, "k4")


def test_kl_reward_penalty_is_reward_to_go_per_sequence() -> None:
    kl = T([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = T([1.0, 1.0, 1.0, 1.0, 0.0])
    seq = T([0, 0, 0, 1, 1])
    assert kl_penalty(kl, mask, seq, 2, coef=0.1).tolist() == pytest.approx([-0.6, -0.5, -0.3, -0.4, 0.0])


def test_entropy() -> None:
    logits = T([[0.0, 0.0, 0.0, 0.0], [math.log(0.75), math.log(0.25), -math.inf, -math.inf]])
    expected = [math.log(4), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]
    assert entropy_from_logits(logits[:1]).tolist() == pytest.approx(expected[:1])
    assert entropy_from_logits(logits[1:, :2]).tolist() == pytest.approx(expected[1:])


def test_tis_truncate_and_mask() -> None:
    rollout = T([0.0, 0.0, 0.0])
    old = T([0.25, 1.0, 3.0]).log()
    w, hit = tis_weights(old, rollout, "truncate", 2.0)
    assert w.tolist() == pytest.approx([0.25, 1.0, 2.0]) and hit.tolist() == [0.0, 0.0, 1.0]
    w, hit = tis_weights(old, rollout, "mask", 2.0)
    assert w.tolist() == [0.0, 1.0, 0.0] and hit.tolist() == [1.0, 0.0, 1.0]
    w, hit = tis_weights(old, rollout, "off", 2.0)
    assert w.tolist() == [1.0, 1.0, 1.0] and hit.sum() == 0
    with pytest.raises(ValueError, match="tis_clip"):
        tis_weights(old, rollout, "truncate", 0.5)


def test_aggregation_token_and_sequence() -> None:
    values = T([1.0, 2.0, 3.0, 4.0])
    mask = T([1.0, 1.0, 0.0, 1.0])
    seq = T([0, 0, 1, 1])
    assert aggregate(values, mask, seq, "token").item() == pytest.approx(7 / 3)
    assert aggregate(values, mask, seq, "sequence").item() == pytest.approx((1.5 + 4.0) / 2)


def test_global_weights_add_up_across_micro_batches() -> None:
    # 3 sequences split over two micro-batches: partial sums with global counts equal the whole
    values = T([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = T([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    seq = T([0, 0, 1, 1, 2, 2])
    for mode in ("token", "sequence"):
        whole = aggregate(values, mask, seq, mode)
        first = (token_weights(mask[:4], seq[:4], 2, mode, 5, 3) * values[:4]).sum()
        second = (token_weights(mask[4:], seq[4:] - 2, 1, mode, 5, 3) * values[4:]).sum()
        assert (first + second).item() == pytest.approx(whole.item())


def _batch(**kw) -> TokenBatch:
    n = 3
    base = dict(
        logp=torch.zeros(n, requires_grad=True),
        old_logp=torch.zeros(n),
        rollout_logp=torch.zeros(n),
        advantages=T([1.0, 1.0, -2.0]),
        mask=torch.ones(n),
        weights=torch.full((n,), 1 / 3),
        seq_index=T([0, 0, 1]),
        n_seqs=2,
    )
    base.update(kw)
    return TokenBatch(**base)


def test_objective_on_policy_is_minus_mean_advantage() -> None:
    loss, sums = policy_objective(_batch(), LossConfig())
    assert loss.item() == pytest.approx(-(1 + 1 - 2) / 3)
    loss.backward()
    assert sums["clip_frac"].item() == 0 and sums["tis_weight"].item() == 3


def test_objective_kl_loss_entropy_bonus_and_kl_in_reward() -> None:
    ref = T([-0.5, 0.0, 0.0])
    logits = torch.zeros(3, 4, requires_grad=True)
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, sums = policy_objective(_batch(ref_logp=ref, entropy=entropy_from_logits(logits)), cfg)
    assert sums["kl_loss"].item() == pytest.approx(0.1 * 0.5 / 3)
    assert sums["entropy_loss"].item() == pytest.approx(-0.01 * math.log(4))
    assert sums["entropy"].item() == pytest.approx(3 * math.log(4))
    assert loss.item() == pytest.approx(0.0 + 0.1 * 0.5 / 3 - 0.01 * math.log(4))
    # the bonus pushes towards uniform: raising one logit of a uniform row lowers the entropy
    lifted = logits.detach().clone()
    lifted[0, 0] = 1.0
    lifted.requires_grad_(True)
    policy_objective(_batch(entropy=entropy_from_logits(lifted)), cfg)[0].backward()
    assert lifted.grad[0, 0] > 0 and lifted.grad[0, 1:].lt(0).all() and lifted.grad[1:].abs().max() < 1e-7
    # as a reward penalty: token 0 of sequence 0 gets -0.1 * (0.5 + 0) added to its advantage
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True)
    _, sums = policy_objective(_batch(ref_logp=ref), cfg)
    assert sums["kl_loss"].item() == 0
    assert sums["pg_loss"].item() == pytest.approx(-(1 - 0.05 + 1 - 2) / 3, rel=1e-5)


def test_objective_gspo_uses_sequence_ratio() -> None:
    logp = T([0.2, -0.2, 0.0]).requires_grad_()
    cfg = LossConfig(eps_clip=0.1, eps_clip_high=0.1)
    token_level, _ = policy_objective(_batch(logp=logp), cfg)
    seq_level, _ = policy_objective(_batch(logp=logp), cfg, sequence_ratio=True)
    # token ratios e^0.2 (clipped to 1.1) and e^-0.2; the sequence ratio of sequence 0 is e^0 = 1
    assert token_level.item() == pytest.approx((-1.1 - math.exp(-0.2) + 2.0) / 3)
    assert seq_level.item() == pytest.approx((-1.0 - 1.0 + 2.0) / 3)
