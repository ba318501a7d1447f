"""Clipped policy-gradient loss (PPO-clip with clip-higher and dual clip) and the GSPO ratio.

Per token, with log-ratio l = log pi(a|s) - log pi_old(a|s), ratio r = exp(l) and advantage A:

    L_clip = max( -A r, -A clip(r, 1 - eps_low, 1 + eps_high) )          (PPO; eps_high > eps_low is
                                                                           "clip-higher", DAPO)
    dual clip (c > 1, only where A < 0):  L = min( L_clip, -c A )         (Ye et al., 2020)

`clipped` marks tokens where the clipped branch is the active one (the clip fraction metric).

GSPO (Zheng et al., 2025) replaces the token ratio by the sequence ratio
    s_i = exp( 1/|y_i| sum_t m_it l_it ),
the geometric mean of the token ratios; `sequence_log_ratio` returns log s_i for every token of
sequence i, and the same clip loss is then applied to it. Gradients flow through every token's l.
Log-ratios are clamped to [-20, 20] before exp so one wild token cannot overflow the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.train.losses.segments import segment_sum

_MAX_LOG_RATIO = 20.0


def ppo_clip_loss(
    log_ratio: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token clipped loss and a 0/1 tensor of tokens where clipping was active."""
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); set train.loss.dual_clip")
        lower = -advantages * dual_clip
        use_dual = (advantages < 0) & (loss > lower)
        loss = torch.where(use_dual, lower, loss)
        active = active | use_dual
    return loss, active.float()


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """GSPO: log s_i = masked mean of the token log-ratios of sequence i, broadcast to its tokens."""
    mask = mask.to(log_ratio.dtype)
    total = segment_sum(log_ratio * mask, seq_index, n_seqs)
    count = segment_sum(mask, seq_index, n_seqs).clamp(min=1.0)
    return (total / count)[seq_index]
