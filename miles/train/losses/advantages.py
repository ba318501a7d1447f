"""Advantage estimators: one scalar per sample from rewards and group structure.

Samples with equal group_id answered the same prompt. With group G(i) of sample i, rewards r:

    GRPO (Shao et al., 2024):   A_i = (r_i - mean_G(i) r) / (std_G(i) r + eps)   (std: unbiased, n-1;
                                the division is skipped when normalize_std is off)
    REINFORCE++ with baseline   a_i = r_i - mean_G(i) r, then whitened over the batch, weighting each
    (Hu et al., 2025):          sample by its trained tokens c_i (the token-level whitening):
                                A_i = (a_i - mu) / (sigma + eps),  mu = sum c a / sum c,
                                sigma^2 = sum c (a - mu)^2 / sum c
    GSPO (Zheng et al., 2025):  the GRPO advantage; what makes GSPO is its sequence-level ratio,
                                which the registry entry turns on (see policy.py).
    PPO (Schulman et al., 2017): no per-sample part (0); the advantage of each token is GAE from a
                                learned value function (value.py), which the backends' critic adds.

A group of one sample has std 0 and advantage 0. The advantage of a sample applies to each of its
response tokens; a KL reward penalty (kl.py) adds a per-token part on top.

Trajectory weights. A black-box agent's episode may come back as several trajectories (sub-agents,
compacted histories), each a sample with `Sample.weight` = 1 / (trajectories of its episode). Group
statistics then count episodes, not trajectories: with weights v, mean_G = sum v r / sum v and the
unbiased variance sum v (r - mean_G)^2 / (sum v - 1) (frequency weights; all weights 1 is the plain
formula above), and REINFORCE++ weights each sample's tokens by v c_i. The loss side is aggregate.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.config.train import LossConfig

EPS = 1e-6


def group_mean_std(
    rewards: Tensor, group_ids: Tensor, weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per sample: mean and unbiased std of the rewards of its group, each sample counting `weights`
    (default 1; std 0 for a group of one episode)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    rewards = rewards.double()
    w = torch.ones_like(rewards) if weights is None else weights.double()
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add(0, inverse, w)
    mean = torch.zeros(n_groups, dtype=rewards.dtype).index_add(0, inverse, w * rewards) / count
    dev2 = w * (rewards - mean[inverse]).square()
    var = torch.zeros(n_groups, dtype=rewards.dtype).index_add(0, inverse, dev2) / (count - 1).clamp(min=1)
    return mean[inverse], var.sqrt()[inverse]


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    token_counts: Tensor,
    normalize_std: bool = True,
    weights: Tensor | None = None,
) -> Tensor:
    """GRPO: group-centred rewards, optionally divided by the group std."""
    mean, std = group_mean_std(rewards, group_ids, weights)
    adv = rewards.double() - mean
    if normalize_std:
        adv = adv / (std + EPS)
    return adv.float()


def reinforce_pp_advantages(
    rewards: Tensor, group_ids: Tensor, token_counts: Tensor, weights: Tensor | None = None
) -> Tensor:
    """REINFORCE++ with a group-mean baseline, whitened over the batch with token weights."""
    mean, _ = group_mean_std(rewards, group_ids, weights)
    adv = rewards.double() - mean
    c = token_counts.double() * (1.0 if weights is None else weights.double())
    if c.sum() <= 0:
        c = torch.ones_like(c)
    mu = (c * adv).sum() / c.sum()
    sigma = ((c * (adv - mu).square()).sum() / c.sum()).sqrt()
    return ((adv - mu) / (sigma + EPS)).float()


@dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage function plus what the policy loss must do with it."""

    compute: Callable[..., Tensor]
    """(rewards, group_ids, token_counts, loss config, weights=None) -> one advantage per sample
    (weights: the samples' trajectory weights, None for all 1)."""
    sequence_ratio: bool = False
    """Use the GSPO sequence-level ratio in the clipped loss instead of the token ratio."""
    critic: bool = False
    """Per-token advantages come from a value function (train.critic), trained in the same step."""


def _grpo(r: Tensor, g: Tensor, c: Tensor, cfg: LossConfig, w: Tensor | None = None) -> Tensor:
    return grpo_advantages(r, g, c, cfg.normalize_std, w)


def _reinforce_pp(r: Tensor, g: Tensor, c: Tensor, cfg: LossConfig, w: Tensor | None = None) -> Tensor:
    return reinforce_pp_advantages(r, g, c, w)


def _no_sample_part(r: Tensor, g: Tensor, c: Tensor, cfg: LossConfig, w: Tensor | None = None) -> Tensor:
    return torch.zeros_like(r, dtype=torch.float32)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(_grpo),
    "reinforce_pp": AdvantageEstimator(_reinforce_pp),
    "gspo": AdvantageEstimator(_grpo, sequence_ratio=True),
    "ppo": AdvantageEstimator(_no_sample_part, critic=True),
}


def get_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator `name`; the error lists the known names."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(
            f"unknown advantage estimator {name!r} (train.loss.advantage); known: {known}"
        ) from None
