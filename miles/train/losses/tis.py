"""Correction of the train/rollout mismatch: truncated importance sampling (TIS) and its mask variant.

The engine samples with pi_rollout (its kernels, maybe another precision), the trainer computes
pi_old for the same weights. The importance weight of a sampled token is

    rho_t = pi_old(a_t|s_t) / pi_rollout(a_t|s_t) = exp(logp_old - logp_rollout)

    truncate:  w_t = min(rho_t, C)                          (Yao et al., 2025, "TIS")
    mask:      w_t = 1 if 1/C <= rho_t <= C else 0          (tokens out of the band leave the loss)
    off:       w_t = 1

w_t multiplies the per-token policy loss and carries no gradient. `hit` marks truncated / masked
tokens (metric tis_clip_frac: their share of trained tokens); `clipped_sequences` counts the
sequences with at least one such token (metric tis_clip_seq_frac: their share of trained sequences).
When old log-probs are taken from the rollout, rho = 1 and the correction is a no-op.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from miles.train.losses.segments import segment_sum

Mode = Literal["off", "truncate", "mask"]


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, mode: Mode, clip: float) -> tuple[Tensor, Tensor]:
    """Per-token importance weights (detached) and a 0/1 tensor of truncated or masked tokens."""
    if clip <= 1.0:
        raise ValueError(f"TIS clip must be > 1 (got {clip}); set train.loss.tis_clip")
    rho = torch.exp((old_logp - rollout_logp).detach().clamp(-20.0, 20.0))
    if mode == "off":
        return torch.ones_like(rho), torch.zeros_like(rho)
    if mode == "truncate":
        return rho.clamp(max=clip), (rho > clip).to(rho.dtype)
    if mode == "mask":
        keep = (rho >= 1.0 / clip) & (rho <= clip)
        return keep.to(rho.dtype), (~keep).to(rho.dtype)
    raise ValueError(f"unknown TIS mode {mode!r}; known: off, truncate, mask (train.loss.tis)")


def clipped_sequences(hit: Tensor, mask: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """Number of sequences with at least one trained token that TIS truncated or masked (detached)."""
    per_seq = segment_sum((mask * hit).detach().float(), seq_index, n_seqs)
    return (per_seq > 0).sum().to(hit.dtype)
