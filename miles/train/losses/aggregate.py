"""Loss aggregation: how per-token values x_it (sequence i, token t, mask m_it) become one number.

    token:     L = sum_it m_it x_it / sum_it m_it              every trained token weighs the same
    sequence:  L = 1/N sum_i ( sum_t m_it x_it / sum_t m_it )  every sequence weighs the same

N counts sequences with at least one trained token. A step's batch is split over ranks and
micro-batches, so the normalisers must be the global ones: `token_weights` returns w with
L = sum_it w_it x_it over the whole batch, and each micro-batch contributes its partial sum.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from miles.train.losses.segments import segment_sum

Aggregation = Literal["token", "sequence"]


def token_weights(
    mask: Tensor, seq_index: Tensor, n_seqs: int, mode: Aggregation, total_tokens: int, total_seqs: int
) -> Tensor:
    """Weights w_it of the aggregation `mode`, given the global token and sequence counts."""
    mask = mask.float()
    if mode == "token":
        return mask / max(total_tokens, 1)
    if mode == "sequence":
        per_seq = segment_sum(mask, seq_index, n_seqs).clamp(min=1.0)
        return mask / (per_seq[seq_index] * max(total_seqs, 1))
    raise ValueError(f"unknown aggregation {mode!r}; known: token, sequence")


def aggregate(values: Tensor, mask: Tensor, seq_index: Tensor, mode: Aggregation) -> Tensor:
    """L of one self-contained batch (the global counts are this batch's own)."""
    n_seqs = int(seq_index.max().item()) + 1 if seq_index.numel() else 0
    per_seq = segment_sum(mask.float(), seq_index, n_seqs)
    w = token_weights(mask, seq_index, n_seqs, mode, int(mask.sum().item()), int((per_seq > 0).sum().item()))
    return (w * values).sum()
