"""Fused expert GEMMs of the CUDA mixture-of-experts layer (miles/engine/moe.py): one Triton launch per
projection over the (token, slot) rows sorted by expert, in block-aligned ranges.

Layout. The T*k (token, slot) pairs of a batch, row r = t * k + slot, are placed in a buffer `rows`
where each expert owns a range that starts on a multiple of BM and holds its rows followed by the
sentinel T*k up to the range's end; `block_expert[b]` is the expert of block b, `used` the end of
the last range. Two kernels build it with no host synchronisation and shapes that depend on T*k
alone: `_count_kernel` (one program) takes the histogram of the ids (per-lane counts summed once
after the loop: no reduction across threads per chunk, and with 8 warps no spill in its sm_90
build, where the per-chunk sums spilled 296 bytes), each expert's range, the blocks' experts and the
sentinel fill; `_place_kernel` puts every row in its expert's range through
an atomic cursor. The order of rows inside a range is not fixed, and need not be: a row's product
sums over the same K blocks in the same order wherever it sits in its tile.

Products. `_expert_gemm_kernel` runs program (m, n) on block m's BM rows and BN output columns of
its expert: C[r, n] = A[r // a_div] . W[e, n, :] for the live rows (not the sentinel), accumulated
in fp32 over BK-wide steps and rounded once, C in (token, slot) order. Where the tiles divide N and K
(the models' shapes) the weight loads take no mask, and the weights are addressed by 32-bit offsets
from the expert's first element: the sm_90 build of the 32-row decode tile then keeps every value in
registers (208 of them) where masks and 64-bit pointers spilled 336 bytes (`python -m
bench.kernel_registers`). Blocks past `used` return at
once, so the grid ([the largest number of blocks], N / BN) is fixed by T*k and the launches are
captured in CUDA graphs. The gate/up product reads x (a_div = k: every slot of a token shares its
row), the down product reads the activations of the rows themselves (a_div = 1).

This is the technique of SGLang's fused MoE (block-aligned ranges per expert, one launch per
projection). Tiles (`tiles`) follow the mean number of rows an expert gets. The tests run the kernels on CPU under Triton's interpreter against the looped
PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _count_kernel(
    ids_ptr, rows_ptr, cursor_ptr, block_expert_ptr, used_ptr, TK, P,
    E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, EP)
    hits = tl.zeros([CHUNK, EP], dtype=tl.int32)  # summed over its rows once, after the loop
    for s in range(0, TK, CHUNK):
        i = s + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < TK, other=EP).to(tl.int32)
        hits += (ids[:, None] == e[None, :]).to(tl.int32)
    counts = tl.sum(hits, axis=0)
    padded = (counts + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + e, end - padded, mask=e < E)
    tl.store(used_ptr, tl.sum(padded, axis=0))
    for s in range(0, P, FILL):
        i = s + tl.arange(0, FILL)
        tl.store(rows_ptr + i, TK, mask=i < P)
    for s in range(0, P // BM, CHUNK):
        b = s + tl.arange(0, CHUNK)
        owner = tl.sum((end[None, :] <= b[:, None] * BM).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(owner, E - 1), mask=b < P // BM)


@triton.jit
def _place_kernel(ids_ptr, rows_ptr, cursor_ptr, TK, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < TK
    e = tl.load(ids_ptr + i, mask=live, other=0)
    at = tl.atomic_add(cursor_ptr + e, 1, mask=live)
    tl.store(rows_ptr + at, i, mask=live)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, c_ptr, rows_ptr, block_expert_ptr, used_ptr,
    N, K, TK, stride_a, stride_we, stride_wn, stride_c,
    A_DIV: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BM >= tl.load(used_ptr):
        return
    rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))
    live = rows < TK
    a_rows = (rows // A_DIV).to(tl.int64)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    a_at = a_ptr + a_rows[:, None] * stride_a + kk[None, :]
    # the expert's weights from one pointer and 32-bit offsets inside them (an expert's [N, K] is far
    # below 2^31 elements): half the registers of a 64-bit pointer per element
    w_expert = w_ptr + e * stride_we
    w_off = n[None, :] * stride_wn + kk[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN:  # BN divides N and BK divides K: only the rows need a mask
            a = tl.load(a_at, mask=live[:, None], other=0.0)
            w = tl.load(w_expert + k0 + w_off)
        else:
            in_k = k0 + kk < K
            a = tl.load(a_at, mask=live[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_expert + k0 + w_off, mask=in_k[:, None] & (n[None, :] < N), other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        a_at += BK
    c_at = c_ptr + rows[:, None].to(tl.int64) * stride_c + n[None, :]
    tl.store(c_at, acc.to(c_ptr.dtype.element_ty), mask=live[:, None] & (n[None, :] < N))


def tiles(rows_per_expert: float) -> dict:
    """Tile sizes and launch settings of `_expert_gemm_kernel` for this mean number of rows per
    expert: 16-row blocks that stream each expert's weights once when experts get a few rows (small
    decode batches), 32-row blocks when they get up to 64 (large decode batches), larger tiles where
    the product is compute-bound (prefill). Chosen by bench/moe_experts_gpu.py --sweep on one H200
    at Qwen3-30B-A3B's layer shapes (bench/RESULTS.md)."""
    if rows_per_expert <= 4:
        return dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return dict(BM=32, BN=128, BK=128, num_warps=8, num_stages=3)
    return dict(BM=64, BN=128, BK=64, num_warps=8, num_stages=3)


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [P] int32, block_expert [P / BM] int32, used [1] int32) of the module docstring for the
    expert ids [T, k]; P, the most the ranges can take, depends on T*k alone."""
    flat = ids.reshape(-1)
    tk = flat.numel()
    p = tk + min(num_experts, tk) * (bm - 1)
    p = triton.cdiv(p, bm) * bm
    dev = ids.device
    rows = torch.empty(p, dtype=torch.int32, device=dev)
    block_expert = torch.empty(p // bm, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(num_experts)
    _count_kernel[(1,)](
        flat,
        rows,
        cursor,
        block_expert,
        used,
        tk,
        p,
        E=num_experts,
        EP=ep,
        BM=bm,
        CHUNK=128,
        FILL=1024,
        num_warps=8,
    )
    _place_kernel[(triton.cdiv(tk, 1024),)](flat, rows, cursor, tk, BLOCK=1024)
    return rows, block_expert, used


def expert_gemm(
    a: torch.Tensor, w: torch.Tensor, layout: tuple, tk: int, a_div: int, cfg: dict
) -> torch.Tensor:
    """C [T*k, N]: row r = a[r // a_div] @ w[expert of r].T, for a [*, K] and w [E, N, K] (the rows'
    layout from `align` with cfg's BM)."""
    rows, block_expert, used = layout
    E, N, K = w.shape
    assert a.stride(-1) == 1 and w.stride(-1) == 1, "the kernel reads rows of a and w contiguously"
    assert N * w.stride(1) < 2**31, "the kernel addresses one expert's weights with 32-bit offsets"
    c = torch.empty(tk, N, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(N, cfg["BN"]))
    _expert_gemm_kernel[grid](
        a, w, c, rows, block_expert, used, N, K, tk, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        A_DIV=a_div, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        EVEN=N % cfg["BN"] == 0 and K % cfg["BK"] == 0, **cfg,
    )  # fmt: skip
    return c


def experts_fused(
    x, ids, gate_up: torch.Tensor, down: torch.Tensor, act, cfg: dict | None = None
) -> torch.Tensor:
    """The experts' outputs y [T*k, H] in (token, slot) order, for x [T, H], ids [T, k], gate_up
    [E, 2I, H], down [E, H, I]; act maps the [T*k, 2I] gate/up product to silu(gate) * up; cfg
    overrides `tiles`."""
    T, k = ids.shape
    E = gate_up.shape[0]
    if T == 0:
        return x.new_empty(0, x.shape[1])
    cfg = cfg or tiles(T * k / E)
    layout = align(ids, E, cfg["BM"])
    gu = expert_gemm(x, gate_up, layout, T * k, k, cfg)
    return expert_gemm(act(gu), down, layout, T * k, 1, cfg)
