"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the mixing weights of its N residual
streams [..., N, hidden], as pure functions of the weights, shared by the engine's decoder
(miles/engine/deepseek_v4.py) and the Megatron modules (miles/train/megatron/deepseek_v4_hc.py).

    f = W_fn RMS(flatten streams)  (fp32, unweighted RMS over N*hidden), split [pre N; post N; comb N*N]
    pre = sigmoid(f_pre a_pre + b_pre) + eps,  post = 2 sigmoid(f_post a_post + b_post),
    comb = Sinkhorn(softmax(f_comb a_comb + b_comb) + eps)  (columns first, then rows and columns)
The head's collapse is pre alone, from its own (fn, base, scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.engine.hybrid_attention import unweighted_rms


def mixes(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    iters: int, hc_eps: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(pre [..., N], post [..., N], comb [..., N, N]) of one mHC site over `streams` [..., N, hidden]."""
    n = streams.shape[-2]
    flat = unweighted_rms(streams.flatten(-2).float(), eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    a_pre, a_post, a_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * a_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * a_post + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * a_comb + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def head_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    eps: float,
) -> torch.Tensor:
    """pre [..., N] of the final collapse (`model.hc_head`)."""
    flat = unweighted_rms(streams.flatten(-2).float(), eps)
    return torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams [..., N, hidden] weighted by pre [..., N] and summed: [..., hidden]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def mix(
    post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: post (x) its output [..., hidden], plus comb^T times the streams it
    read (the post-mix on the block's output, added after the residual mix)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )
