"""Causal attention over sequences packed back to back in one row, with no [T, T] mask.

A packed row holds n sequences of lengths l_0 .. l_{n-1} (T tokens in all), described by their
offsets cu_seqlens = (0, l_0, l_0 + l_1, ..., T). Token i of sequence s attends keys j of the same
sequence with j <= i and nothing else:

    out_i = softmax_j(q_i . k_j * scale  for j in [start_s, i]) . v

which equals causal attention run on each sequence alone. Two kernels compute it:

- CUDA, bf16 / fp16: PyTorch's flash-attention variable-length kernel
  (`torch.nn.attention.varlen.varlen_attn`, window (-1, 0) = causal), one launch for the whole row;
  its work grows with sum(l_s^2), not T^2.
- anywhere else (the CPU, fp32, a torch without the varlen module): scaled_dot_product_attention with
  `is_causal=True` on each sequence in turn (exact; one call per sequence).

A [1, 1, T, T] block-causal mask through SDPA computes the same numbers, but no fused SDPA kernel
takes an arbitrary mask, so it runs the math kernel (about 20x slower at 32 x 640 tokens on an H200,
docs and bench/RESULTS.md) and holds T^2 bytes. Grouped-query key/value heads are repeated to the
query heads first (the varlen kernel of torch 2.11 needs equal head counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the per-sequence path only
    varlen_attn = None


def uses_varlen_kernel(q: Tensor) -> bool:
    """Whether `packed_causal_attention` runs the one-launch flash kernel for a query like `q`."""
    return varlen_attn is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def packed_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float | None = None
) -> Tensor:
    """Causal attention of packed sequences. q [T, Hq, D], k / v [T, Hkv, D] (Hq a multiple of Hkv),
    cu_seqlens [n + 1] int32 on q's device, max_seqlen the longest l_s. Returns [T, Hq, D]."""
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if uses_varlen_kernel(q):
        return varlen_attn(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0)
        )
    lengths = cu_seqlens.diff().tolist()
    outs = [
        F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True, scale=scale
        )
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
    ]
    return torch.cat([o.transpose(0, 1) for o in outs])
