"""Fused elementwise kernels of the CUDA decoder forward: each replaces a handful of small PyTorch
kernels per layer (a decode step's time is set by its kernel count, ~2.5 us each even in a graph).

Maths (the same as the decoder's per-op path in miles/engine/model.py, rounding for rounding):
- add_rms_norm_: the residual stream x is fp32; a sublayer's output delta (bf16) is added in fp32,
      x <- x + delta,   y = (w * (x * rsqrt(mean(x^2) + eps))).to(dtype)
  with w (bf16) promoted to fp32 and one rounding of y. One program per row holds the whole row.
- rope_store_kv: from the fused projection qkv = [q | k | v] ([T, (H + 2 KVH) * D], heads of D),
      rope(x) = (x * cos + rotate_half(x) * sin).to(dtype),   rotate_half([x1, x2]) = [-x2, x1]
  computed in fp32 (x1 * c - x2 * s and x2 * c + x1 * s: the same products and sums as the
  per-op path) and rounded once; q goes to a new [T, H, D] tensor, rotated k and plain v to the pool
  at slot write_slots[t] ([KVH, slots, D]). With Qwen3's per-head norms, q and k are first
      n = (rms_norm(x) in fp32).to(dtype),   x <- (w * n).to(dtype)
  (two roundings, as the per-op path: rms_norm of a bf16 tensor, then a bf16 product).
- silu_mul: from gu = [gate | up] ([T, 2I]),
      a = (g / (1 + exp(-g))).to(dtype),   out = (a * u).to(dtype)
  both in fp32: the two roundings of F.silu(gate) * up in bf16.
Products and sums are compiled without FMA contraction (`enable_fp_fusion=False`), so each rounds as
PyTorch's separate kernels do; the silu divides with IEEE division, and on the GPU takes exp from
libdevice (expf, as PyTorch's kernel) rather than Triton's ex2.approx. What can still differ from the
per-op path: the order of the sum of squares and the rsqrt of the norms (fp32 ulps, before the one
rounding to bf16).

Grids and buffers depend on shapes alone (no host synchronisation), so the calls can be captured in
a CUDA graph. Imported only where CUDA tensors are run (Triton is part of PyTorch's CUDA builds); the
tests run the kernels on CPU under Triton's interpreter, where exp is numpy's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

EXACT = dict(enable_fp_fusion=False)  # no FMA contraction: round each product and sum as PyTorch does


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, y_ptr, stride_x, stride_d, stride_y, N, eps,
    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    live = n < N
    x = tl.load(x_ptr + t * stride_x + n, mask=live, other=0.0)
    if HAS_DELTA:
        x = x + tl.load(delta_ptr + t * stride_d + n, mask=live, other=0.0).to(tl.float32)
        tl.store(x_ptr + t * stride_x + n, x, mask=live)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + n, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + n, (w * (x * rstd)).to(y_ptr.dtype.element_ty), mask=live)


def add_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """x <- x + delta in place (x fp32 [T, N], delta [T, N] or None) and the normed rows [T, N] in
    out_dtype; see the module docstring."""
    T, N = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and weight.shape == (N,) and weight.is_contiguous()
    assert delta is None or (delta.shape == x.shape and delta.stride(1) == 1)
    y = torch.empty(T, N, dtype=out_dtype, device=x.device)
    if T == 0:
        return y
    block = triton.next_power_of_2(N)
    d = x if delta is None else delta
    _add_rms_norm_kernel[(T,)](
        x, d, weight, y, x.stride(0), d.stride(0), y.stride(0), N, eps,
        BLOCK=block, HAS_DELTA=delta is not None, num_warps=min(16, max(1, block // 256)), **EXACT,
    )  # fmt: skip
    return y


@triton.jit
def _head_norm(x1, x2, w_ptr, i, live, eps, D: tl.constexpr, out_ty: tl.constexpr):
    """Qwen3's per-head RMSNorm of [heads, D/2] halves (fp32 values of dtype), rounded as the per-op path."""
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
    w1 = tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + D // 2 + i, mask=live, other=0.0).to(tl.float32)[None, :]
    y1 = (x1 * rstd).to(out_ty).to(tl.float32)
    y2 = (x2 * rstd).to(out_ty).to(tl.float32)
    return (w1 * y1).to(out_ty).to(tl.float32), (w2 * y2).to(out_ty).to(tl.float32)


@triton.jit
def _lora_cols(
    base, cols, mask, t, h_ptr, b_ptr, slot_ptr, scale_ptr, stride_h, stride_b,
    M: tl.constexpr, R: tl.constexpr, SR: tl.constexpr, JB: tl.constexpr, out_ty: tl.constexpr,
):  # fmt: skip
    """Token t's values at the fused projection's columns `cols` (a [heads, D/2] block of B's rows):
    its base output `base` (fp32) plus the LoRA term of member M (q 0, k 1, v 2), rounded once to out_ty,
    as miles/engine/triton_lora.py's `lora_split` writes them (the B product summed in another order).
    Only the token's own slot's R columns are read (the other slots' are zero in that product)."""
    slot = tl.load(slot_ptr + t)
    scale = tl.load(scale_ptr + tl.maximum(slot, 0))
    low = b_ptr.dtype.element_ty
    term = tl.zeros(base.shape, dtype=tl.float32)
    for j0 in tl.static_range(0, R, JB):
        j = M * SR + tl.maximum(slot, 0) * R + j0 + tl.arange(0, JB)
        h = tl.where(slot >= 0, tl.load(h_ptr + t * stride_h + j).to(tl.float32) * scale, 0.0)
        h = h.to(low).to(tl.float32)
        b = tl.load(b_ptr + cols[:, :, None] * stride_b + j[None, None, :], mask=mask[:, :, None], other=0.0)
        term += tl.sum(b.to(tl.float32) * h[None, None, :], axis=2)
    return (base + term).to(out_ty).to(tl.float32)


@triton.jit
def _rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_pool_ptr, v_pool_ptr, qn_ptr, kn_ptr,
    h_ptr, b_ptr, lora_slot_ptr, scale_ptr,
    stride_t, stride_c, stride_ph, stride_ps, stride_h, stride_b, eps,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
    H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, HALF_PAD: tl.constexpr, QK_NORM: tl.constexpr,
    LORA: tl.constexpr, R: tl.constexpr, SR: tl.constexpr, JB: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF_PAD)
    live = i < HALF
    c = tl.load(cos_ptr + t * stride_c + i, mask=live, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_c + i, mask=live, other=0.0)[None, :]
    row = qkv_ptr + t * stride_t
    out_ty = q_ptr.dtype.element_ty
    lora = (t, h_ptr, b_ptr, lora_slot_ptr, scale_ptr, stride_h, stride_b)

    h = tl.arange(0, H_PAD)[:, None]
    mask = (h < H) & live[None, :]
    x1 = tl.load(row + h * D + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + h * D + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    if LORA:
        x1 = _lora_cols(x1, h * D + i[None, :], mask, *lora, 0, R, SR, JB, out_ty)
        x2 = _lora_cols(x2, h * D + HALF + i[None, :], mask, *lora, 0, R, SR, JB, out_ty)
    if QK_NORM:
        x1, x2 = _head_norm(x1, x2, qn_ptr, i, live, eps, D, out_ty)
    q_row = q_ptr + t * (H * D) + h * D + i[None, :]
    tl.store(q_row, (x1 * c - x2 * s).to(out_ty), mask=mask)
    tl.store(q_row + HALF, (x2 * c + x1 * s).to(out_ty), mask=mask)

    j = tl.arange(0, KVH_PAD).to(tl.int64)[:, None]  # j * stride_ph may pass 2^31 in a large pool
    mask = (j < KVH) & live[None, :]
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dest = j * stride_ph + slot * stride_ps + i[None, :]
    x1 = tl.load(row + (H + j) * D + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + (H + j) * D + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    if LORA:
        x1 = _lora_cols(x1, (H + j) * D + i[None, :], mask, *lora, 1, R, SR, JB, out_ty)
        x2 = _lora_cols(x2, (H + j) * D + HALF + i[None, :], mask, *lora, 1, R, SR, JB, out_ty)
    if QK_NORM:
        x1, x2 = _head_norm(x1, x2, kn_ptr, i, live, eps, D, out_ty)
    tl.store(k_pool_ptr + dest, (x1 * c - x2 * s).to(out_ty), mask=mask)
    tl.store(k_pool_ptr + dest + HALF, (x2 * c + x1 * s).to(out_ty), mask=mask)
    v1 = tl.load(row + (H + KVH + j) * D + i[None, :], mask=mask, other=0.0)
    v2 = tl.load(row + (H + KVH + j) * D + HALF + i[None, :], mask=mask, other=0.0)
    if LORA:
        v1 = _lora_cols(v1.to(tl.float32), (H + KVH + j) * D + i[None, :], mask, *lora, 2, R, SR, JB, out_ty)
        v2 = _lora_cols(
            v2.to(tl.float32), (H + KVH + j) * D + HALF + i[None, :], mask, *lora, 2, R, SR, JB, out_ty
        )
        v1, v2 = v1.to(out_ty), v2.to(out_ty)
    tl.store(v_pool_ptr + dest, v1, mask=mask)
    tl.store(v_pool_ptr + dest + HALF, v2, mask=mask)


def rope_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    write_slots: torch.Tensor,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    lora: tuple | None = None,
) -> torch.Tensor:
    """Rotated q [T, H, D] (qkv's dtype); rotated k and v written to the pools at write_slots.

    qkv [T, (H + 2 KVH) * D] (rows may be strided); cos, sin fp32 [T, D/2] (of the angles pos * freq);
    k_pool, v_pool [KVH, slots, D] with equal strides; write_slots [T] int64; q_norm, k_norm: Qwen3's
    per-head norm weights [D] (both or neither), applied before RoPE with `eps`. `lora`: (h, b,
    token_slots, scale, rank, width) of a q/k/v LoRA group (miles/engine/triton_lora.py: h = x A^T [T,
    3 width], b block-diagonal [(H + 2 KVH) D, 3 width]): qkv is then the base output, and each value
    is first what `lora_split` would have written."""
    KVH, _, D = k_pool.shape
    T, H = qkv.shape[0], num_heads
    assert qkv.shape[1] == (H + 2 * KVH) * D and qkv.stride(1) == 1 and D % 2 == 0, "qkv shape"
    assert cos.shape == sin.shape == (T, D // 2) and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert v_pool.shape == k_pool.shape and v_pool.stride() == k_pool.stride() and k_pool.stride(2) == 1
    assert k_pool.dtype == v_pool.dtype == qkv.dtype and write_slots.shape == (T,)
    q = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    slots = write_slots.contiguous()
    assert (q_norm is None) == (k_norm is None), "Qwen3 normalises both q and k"
    qn, kn = (q, q) if q_norm is None else (q_norm, k_norm)
    h_pad, half_pad = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
    if lora is None:
        h, b, lora_slots, scale, rank, width, jb = q, q, slots, cos, 1, 1, 1
    else:
        h, b, lora_slots, scale, rank, width = lora
        assert h.shape == (T, 3 * width) and h.stride(1) == 1 and b.shape == (qkv.shape[1], 3 * width)
        jb = min(rank, max(1, 4096 // (h_pad * half_pad)))  # [heads, D/2, jb] products at a time
    _rope_store_kernel[(T,)](
        qkv, cos, sin, slots, q, k_pool, v_pool, qn, kn, h, b, lora_slots, scale,
        qkv.stride(0), cos.stride(0), k_pool.stride(0), k_pool.stride(1), h.stride(0), b.stride(0), eps,
        H=H, KVH=KVH, D=D, H_PAD=h_pad, KVH_PAD=triton.next_power_of_2(KVH), HALF_PAD=half_pad,
        QK_NORM=q_norm is not None, LORA=lora is not None, R=rank, SR=width, JB=jb, num_warps=4, **EXACT,
    )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, stride_g, stride_o, inter, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = n < inter
    g = tl.load(gu_ptr + t * stride_g + n, mask=live, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_g + inter + n, mask=live, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    out_ty = out_ptr.dtype.element_ty
    a = tl.math.div_rn(g, 1.0 + e).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + n, (a * u).to(out_ty), mask=live)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(gate) * up [T, I] (gate_up's dtype) of gate_up = [gate | up] [T, 2I]; `block` a power of 2."""
    T, I2 = gate_up.shape
    assert I2 % 2 == 0 and gate_up.stride(1) == 1 and block & (block - 1) == 0
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    _silu_mul_kernel[(T, triton.cdiv(I2 // 2, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), I2 // 2,
        BLOCK=block, LIBDEVICE=gate_up.is_cuda, num_warps=4, **EXACT,
    )  # fmt: skip
    return out
