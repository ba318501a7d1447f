"""Triton kernels of the fused log-prob + entropy op; the maths and the autograd wiring are in
fused_logprob.py, which imports this module only for CUDA tensors (Triton is part of PyTorch's CUDA
builds) and in tests under Triton's interpreter.

Forward: one program per selected row streams the row once in blocks of BLOCK logits. Each lane
keeps its own running maximum m, sum s = sum exp(z - m) and (for the entropy) d = sum exp(z - m) z;
one exp per logit: when z exceeds m the old sums are rescaled by exp(m - z) and z enters with
weight 1, otherwise z enters with weight exp(z - m). The lanes are combined once at the end:
M = max m, S = sum s exp(m - M), lse = M + log S, E_p[z] = sum d exp(m - M) / S.

Backward: one program per row of the logits (selected or not), so every row of the gradient is
written exactly once: zeros where no token is scored, else the gradient of the selected row,
recomputing p = exp(z - lse) from the logits and the saved lse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
"""Logits per block (8 warps, 8 per thread); any BLOCK works for any vocabulary size."""


@triton.jit
def _forward_kernel(
    logits_ptr,
    stride,
    rows_ptr,
    targets_ptr,
    logp_ptr,
    lse_ptr,
    mean_ptr,
    vocab,
    temperature,
    ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + t).to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], -1e30, tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    run_dot = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        valid = offs < vocab
        z = tl.load(base + offs, mask=valid, other=-float("inf")).to(tl.float32) / temperature
        delta = z - run_max
        ex = tl.exp(-tl.abs(delta))  # exp(m - z) when z is the new maximum, else exp(z - m)
        up = delta > 0
        run_sum = tl.where(up, run_sum * ex + 1.0, run_sum + ex)
        if ENTROPY:
            zv = tl.where(valid, z, 0.0)  # padding lanes: 0 * -inf would be NaN
            run_dot = tl.where(up, run_dot * ex + zv, run_dot + ex * zv)
        run_max = tl.maximum(run_max, z)
    row_max = tl.max(run_max, axis=0)
    weight = tl.exp(run_max - row_max)
    total = tl.sum(run_sum * weight, axis=0)
    lse = row_max + tl.log(total)
    z_target = tl.load(base + tl.load(targets_ptr + t)).to(tl.float32) / temperature
    tl.store(logp_ptr + t, z_target - lse)
    tl.store(lse_ptr + t, lse)
    if ENTROPY:
        tl.store(mean_ptr + t, tl.sum(run_dot * weight, axis=0) / total)


@triton.jit
def _backward_kernel(
    logits_ptr,
    stride,
    grad_ptr,
    slot_ptr,
    targets_ptr,
    lse_ptr,
    mean_ptr,
    grad_logp_ptr,
    grad_ent_ptr,
    vocab,
    temperature,
    ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    out = grad_ptr + row * vocab
    lanes = tl.arange(0, BLOCK)
    t = tl.load(slot_ptr + row)
    if t < 0:
        zero = tl.zeros([BLOCK], tl.float32).to(grad_ptr.dtype.element_ty)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            tl.store(out + offs, zero, mask=offs < vocab)
    else:
        base = logits_ptr + row * stride
        target = tl.load(targets_ptr + t)
        lse = tl.load(lse_ptr + t)
        g_logp = tl.load(grad_logp_ptr + t)
        if ENTROPY:
            g_ent = tl.load(grad_ent_ptr + t)
            mean = tl.load(mean_ptr + t)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            valid = offs < vocab
            z = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) / temperature
            p = tl.exp(z - lse)
            g = tl.where(offs == target, g_logp, 0.0) - g_logp * p
            if ENTROPY:
                g -= g_ent * p * (z - mean)
            tl.store(out + offs, (g / temperature).to(grad_ptr.dtype.element_ty), mask=valid)


def forward(
    logits: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp, lse, E_p[z] or None), each [T] fp32, of the rows `rows` of logits [N, V]."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [N, V] with contiguous rows"
    n_tokens, vocab = rows.numel(), logits.shape[1]
    logp = torch.empty(n_tokens, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    mean = torch.empty_like(logp) if with_entropy else None
    if n_tokens:
        _forward_kernel[(n_tokens,)](
            logits,
            logits.stride(0),
            rows.contiguous(),
            targets.contiguous(),
            logp,
            lse,
            lse if mean is None else mean,
            vocab,
            float(temperature),
            ENTROPY=with_entropy,
            BLOCK=block,
            num_warps=8,
        )
    return logp, lse, mean


def backward(
    logits: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean: torch.Tensor | None,
    grad_logp: torch.Tensor,
    grad_ent: torch.Tensor | None,
    temperature: float,
    block: int = BLOCK,
) -> torch.Tensor:
    """d loss / d logits, a contiguous [N, V] tensor of logits' dtype (grad_ent None: no entropy term)."""
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
    # token index of each logits row, -1 where none (rows are distinct, so no write is lost)
    slot = torch.full((n_rows,), -1, dtype=torch.int64, device=logits.device)
    slot[rows] = torch.arange(rows.numel(), device=logits.device)
    entropy = grad_ent is not None
    if n_rows:
        _backward_kernel[(n_rows,)](
            logits,
            logits.stride(0),
            grad,
            slot,
            targets.contiguous(),
            lse,
            mean if entropy else lse,
            grad_logp.float().contiguous(),
            grad_ent.float().contiguous() if entropy else lse,
            vocab,
            float(temperature),
            ENTROPY=entropy,
            BLOCK=block,
            num_warps=8,
        )
    return grad
