"""Paged decode attention on CUDA: one query token per request, keys and values read in place from
the slot pool, so the per-layer gather into a padded [KVH*B, L, D] copy is never made.

Maths (the same as `reference_decode_attention`, the gather + SDPA path of the decoder): for request
b, kv head j and query head h = j*G + g (G = H/KVH query heads share kv head j),
    out[b, h] = sum_{n <= p_b} softmax_n(scale * q[b, h] . K[j, s_bn]) V[j, s_bn]
with s_bn = context_slots[b, n] and p_b = min(max(positions[b], 0), L - 1): the query sees keys
0..p_b (key 0 always, as the decoder's mask). The softmax is the online one of flash attention, in
fp32, base 2 (scale is multiplied by log2 e once): over blocks of BLOCK_N keys the kernel keeps per
query head a running maximum m, a running sum l of 2^(x - m) and an unnormalised output acc, each
rescaled by 2^(m_old - m_new) when the maximum grows.

Grid: one program per (request, kv head, split). Each program computes all G query heads of its kv
head at once (one tl.dot over a [G, D] x [D, BLOCK_N] tile), so every K/V row is loaded once for the
group. With one split the program writes the normalised output; with S > 1 splits (flash decoding)
split i covers keys [i*chunk, (i+1)*chunk), writes its normalised partial output o_i and its
log-sum-exp lse_i = m_i + log2 l_i, and a second kernel combines them:
    out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M),   M = max_i lse_i.
A split wholly past p_b runs no iteration and contributes lse = -inf, weight 0; split 0 always holds
key 0, so M is finite. Programs skip key blocks past p_b, so padded contexts cost their slot-index
reads only up to the query's own length.

Programs run 4 warps, 8 for a head dim of 128 or more: with 4, the sm_90 build at head dim 128 spills
64-144 bytes of registers (`python -m bench.kernel_registers`), with 8 it keeps them all.

The grid and every buffer depend on shapes alone (no host synchronisation, no data-dependent
allocation), so a call can be captured in a CUDA graph. Tiles are upcast to fp32 as they are loaded
and both dots accumulate in fp32. fp32 inputs use IEEE fp32 dots (no TF32 rounding). bf16/fp16 inputs
use TF32 tensor-core dots: their values are exact in TF32, so the q.k products are exact, and the
probabilities enter P.V rounded to TF32's 10-bit mantissa (finer than the bf16 rounding of flash
attention). The kernel is bound by memory traffic, not by the dots; and one code path serves the GPU
and Triton's CPU interpreter, whose tl.dot multiplies the raw bits of bf16 operands. Left out: more than one query per request
(prefill keeps the gather path), sliding windows, soft-capping, alibi.

Imported only where CUDA tensors are attended (Triton is part of PyTorch's CUDA builds); the tests
run it on CPU under Triton's interpreter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_sb,
    stride_ob, stride_oh, stride_os, L, chunk, scale_log2,
    G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * G + g
    qd_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    q = q.to(tl.float32)
    last = tl.minimum(tl.maximum(tl.load(pos_ptr + b), 0), L - 1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, last + 1)
    m_i = tl.full([G_PAD], -float("inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        live = n < hi
        slot = tl.load(slots_ptr + b * stride_sb + n, mask=live, other=0).to(tl.int64)
        kv_mask = live[:, None] & (d < D)[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(live[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.maximum(l_i, 1e-30)[:, None]  # an empty split has acc = 0, l = 0: o = 0
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qd_mask)
    if SPLIT:
        lse_ptrs = lse_ptr + (b * (G * tl.num_programs(1)) + heads) * tl.num_programs(2) + split
        tl.store(lse_ptrs, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g < G)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, H,
    S: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    row = b * H + h
    lse = tl.load(lse_ptr + row * S + i, mask=i < S, other=-float("inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    mask = (i < S)[:, None] & (d < D)[None, :]
    o = tl.load(part_ptr + (row * S + i[:, None]) * D + d[None, :], mask=mask, other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def default_splits(batch: int, kv_heads: int, context_len: int, block_n: int, device: torch.device) -> int:
    """Key splits per (request, kv head): split only while there are fewer programs than
    multiprocessors, never a split shorter than two key blocks (on an H200 at batch 256, one split
    beat 2-8 at every context: bench/decode_attention_gpu.py). A pure function of shapes, so graph
    replays keep their grid."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    want = math.ceil(sms / max(1, batch * kv_heads))
    return max(1, min(want, context_len // (2 * block_n)))


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    context_slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Decode attention [B, H, D] (q's dtype) of one query per request over keys read from the pool.

    q [B, H, D]; k_pool, v_pool [KVH, S, D] (last dim contiguous); context_slots [B, L] int64, the
    pool slot of each context position (padding: any valid slot); positions [B] int64, the query's
    position (it sees keys 0..positions[b]). `num_splits` None picks `default_splits`.
    """
    B, H, D = q.shape
    KVH, L = k_pool.shape[0], context_slots.shape[1]
    assert H % KVH == 0 and v_pool.shape == k_pool.shape and k_pool.shape[2] == D, "shapes disagree"
    assert k_pool.dtype == v_pool.dtype == q.dtype, "q and the pools must share a dtype"
    assert q.stride(2) == 1 and k_pool.stride(2) == 1 and v_pool.stride(2) == 1, "head dim must be contiguous"
    assert L >= 1 and block_n >= 16 and block_n & (block_n - 1) == 0, (
        "need context >= 1, block_n a power of 2"
    )
    G = H // KVH
    slots = context_slots if context_slots.stride(1) == 1 else context_slots.contiguous()
    splits = num_splits or default_splits(B, KVH, L, block_n, q.device)
    chunk = math.ceil(math.ceil(L / splits) / block_n) * block_n
    splits = math.ceil(L / chunk)  # no split starts past the context
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(D))
    meta = dict(
        G=G, D=D, G_PAD=max(16, triton.next_power_of_2(G)), D_PAD=d_pad,
        BLOCK_N=block_n, SPLIT=splits > 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if d_pad >= 128 else 4,  # head dim 128 with 4 warps spills (bench.kernel_registers)
    )  # fmt: skip
    if splits > 1:
        part = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        dest, strides = part, (part.stride(0), part.stride(1), part.stride(2))
    else:
        lse, dest, strides = out, out, (out.stride(0), out.stride(1), 0)
    _decode_kernel[(B, KVH, splits)](
        q, k_pool, v_pool, slots, positions, dest, lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        slots.stride(0), *strides, L, chunk, scale * LOG2E, **meta,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(B, H)](
            part, lse, out, out.stride(0), out.stride(1), H,
            S=splits, S_PAD=triton.next_power_of_2(splits), D=D, D_PAD=triton.next_power_of_2(D),
        )  # fmt: skip
    return out


def reference_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    context_slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention computed as the decoder's gather path: K/V gathered into [KVH*B, 1, L, D],
    the G query heads of each kv head folded into the query length, an additive 0/-inf mask of keys
    0..positions[b], one scaled_dot_product_attention call. The kernel's tests and benchmark compare
    against it."""
    B, H, D = q.shape
    KVH, L = k_pool.shape[0], context_slots.shape[1]
    G = H // KVH
    kb = k_pool[:, context_slots].view(KVH * B, 1, L, D)
    vb = v_pool[:, context_slots].view(KVH * B, 1, L, D)
    qb = q.view(B, KVH, G, D).transpose(0, 1).reshape(KVH * B, 1, G, D)
    seen = torch.arange(L, device=q.device)[None, :] <= positions.clamp(min=0)[:, None]
    seen = seen[None, :, None, None, :].expand(KVH, B, 1, G, L).reshape(KVH * B, 1, G, L)
    mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
    return out.view(KVH, B, G, D).transpose(0, 1).reshape(B, H, D)
