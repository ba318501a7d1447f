"""Per-sequence reductions over flat token tensors.

The trainer keeps the response tokens of a micro-batch in one flat tensor; `seq_index[t]` says which
sequence token t belongs to (tokens of one sequence are contiguous and in order). These helpers
reduce or scan within sequences without Python loops.
"""

from __future__ import annotations

import torch
from torch import Tensor


def segment_sum(values: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """out[i] = sum of values[t] over tokens t with seq_index[t] == i."""
    out = torch.zeros(n_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq_index, values)


def segment_reverse_cumsum(values: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """out[t] = sum of values[t'] for t' >= t in the same sequence (reward-to-go, undiscounted)."""
    running = torch.cumsum(values, 0)
    ends = torch.cumsum(segment_sum(values, seq_index, n_seqs), 0)
    return ends[seq_index] - running + values
