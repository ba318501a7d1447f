"""KL divergence to a frozen reference policy, estimated per sampled token (Schulman, 2020).

With log-ratio l = log pi(a|s) - log pi_ref(a|s) for a ~ pi (so the reference-to-policy ratio is
r = exp(-l)):

    k1 = l                       unbiased, high variance, can be negative
    k2 = l^2 / 2                 biased, low variance; its gradient is that of KL(pi || pi_ref)
    k3 = r - 1 - log r = exp(-l) - 1 + l      unbiased, always >= 0 ("low_var_kl")

As a loss the trainer adds kl_coef * aggregate(k). As a reward penalty each token gets reward
-kl_coef * k_t, accumulated as an undiscounted reward-to-go that is added to the token's
advantage (`kl_penalty`); then pi is the old (sampling) policy and no gradient flows through it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from miles.train.losses.segments import segment_reverse_cumsum

Estimator = Literal["k1", "k2", "k3"]


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: Estimator) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate from log-probs of the sampled tokens."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # clamp keeps exp finite when the policy has drifted far from the reference
        return torch.exp(-log_ratio.clamp(-20.0, 20.0)) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; known: k1, k2, k3 (train.loss.kl_estimator)")


def kl_penalty(kl: Tensor, mask: Tensor, seq_index: Tensor, n_seqs: int, coef: float) -> Tensor:
    """Per-token advantage change -coef * sum_{t' >= t} m_t' k_t' (reward-to-go of the penalty)."""
    return -coef * segment_reverse_cumsum(kl * mask.to(kl.dtype), seq_index, n_seqs)
