"""Entropy of the policy's next-token distribution, for the entropy bonus and the entropy metric.

    H(p) = - sum_v p_v log p_v = logsumexp(z) - sum_v softmax(z)_v z_v     for logits z

The bonus enters the loss as -entropy_coef * aggregate(H), so minimising the loss raises entropy.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy over the last dimension of `logits` (natural log)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
