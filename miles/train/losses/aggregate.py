"""Loss aggregation: how per-token values x_it (sequence i, token t, mask m_it) become one number.

    token:     L = sum_it m_it x_it / sum_it m_it              every trained token weighs the same
    sequence:  L = 1/N sum_i ( sum_t m_it x_it / sum_t m_it )  every sequence weighs the same

N counts sequences with at least one trained token. A step's batch is split over ranks and
micro-batches, so the normalisers must be the global ones: `token_weights` returns w with
L = sum_it w_it x_it over the whole batch, and each micro-batch contributes its partial sum.

With trajectory weights v_i (`Sample.weight`: 1 / trajectories of the sample's episode; advantages.py)
every sum over sequences counts v_i instead of 1:

    token:     L = sum_it v_i m_it x_it / sum_it v_i m_it
    sequence:  L = 1/N_v sum_i v_i ( sum_t m_it x_it / sum_t m_it ),   N_v = sum_i v_i [i has a trained token]

so an episode that came back as five trajectories weighs what it would as one (exactly in the sequence
mode; in the token mode by its mean trajectory length). `normalizers` gives the global sums.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from miles.train.losses.segments import segment_sum

Aggregation = Literal["token", "sequence"]


def token_weights(
    mask: Tensor,
    seq_index: Tensor,
    n_seqs: int,
    mode: Aggregation,
    total_tokens: float,
    total_seqs: float,
    seq_weight: Tensor | None = None,
) -> Tensor:
    """Weights w_it of the aggregation `mode`, given the global (weighted) token and sequence counts
    and, optionally, each sequence's trajectory weight [n_seqs]."""
    mask = mask.float()
    per_seq = segment_sum(mask, seq_index, n_seqs).clamp(min=1.0) if mode == "sequence" else None
    if seq_weight is not None:
        mask = mask * seq_weight.to(mask.device, mask.dtype)[seq_index]
    if mode == "token":
        return mask / max(total_tokens, 1e-12)
    if mode == "sequence":
        assert per_seq is not None
        return mask / (per_seq[seq_index] * max(total_seqs, 1e-12))
    raise ValueError(f"unknown aggregation {mode!r}; known: token, sequence")


def normalizers(masks: list[list[int]], weights: list[float] | None = None) -> tuple[float, float]:
    """(sum_i v_i sum_t m_it, sum_i v_i [i has a trained token]) of a batch: the global counts
    `token_weights` takes (weights None: all 1, so the plain token and sequence counts)."""
    v = weights or [1.0] * len(masks)
    tokens = sum(w * sum(m) for w, m in zip(v, masks, strict=True))
    seqs = sum(w for w, m in zip(v, masks, strict=True) if sum(m) > 0)
    return float(tokens), float(seqs)


def aggregate(values: Tensor, mask: Tensor, seq_index: Tensor, mode: Aggregation) -> Tensor:
    """L of one self-contained batch (the global counts are this batch's own)."""
    n_seqs = int(seq_index.max().item()) + 1 if seq_index.numel() else 0
    per_seq = segment_sum(mask.float(), seq_index, n_seqs)
    w = token_weights(mask, seq_index, n_seqs, mode, int(mask.sum().item()), int((per_seq > 0).sum().item()))
    return (w * values).sum()
