"""Triton kernels of the FP8 contract (miles/quant/fp8.py holds the maths and the torch reference).

Every op follows the contract's IEEE-rounded steps, so the bytes equal the torch reference:
`tl.div_rn` for both divisions (Triton's `/` on fp32 is an approximate division, which changed a few
bytes per million on a 4864x896 weight), a plain multiply by the reciprocal (no fused multiply-add
is possible: nothing is added, and the kernels are compiled with `enable_fp_fusion=False` all the
same), min/max for the clamp and a round-to-nearest-even cast to
float8_e4m3fn.

Two kernels cover weights and activations alike:
- `_tile_kernel`: one program per ROWS x COLS tile (a 128x128 weight block, or a 1 x group slice of
  an activation row); partial tiles at the edges are masked and take the amax of what they hold.
- `_row_kernel`: one program per row of any length (row-wise weights, per-token activations),
  two passes over the row in chunks of CHUNK: amax, then quantise.

`block_mm` is the GEMM of block-layout weights: cuBLASLt's DeepSeek-style blockwise scaled GEMM
(activations 1x128, weights 128x128, `torch.nn.functional.scaled_mm` with `ScalingType.BlockWise1x128`
and `BlockWise128x128`), which PyTorch offers only on sm90 with cuBLASLt >= 12.9. Elsewhere (and if
that call is refused) it answers None and `fp8_linear` dequantises the weight and runs a GEMM in the
activations' dtype: correct values, no FP8 speed-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-10)
BLOCK = 128
CHUNK = 1024
"""Elements per step of the row kernel (any row length works)."""

_BLOCK_MM_REFUSED: set[tuple[str, int | None]] = set()
"""Devices where the blockwise scaled GEMM raised once; they dequantise from then on."""


@triton.jit
def _tile_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    tile_rows,
    tile_cols,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    r = pr * tile_rows + tl.arange(0, ROWS)
    c = pc * tile_cols + tl.arange(0, COLS)
    valid = ((r < n_rows) & (tl.arange(0, ROWS) < tile_rows))[:, None] & (
        (c < n_cols) & (tl.arange(0, COLS) < tile_cols)
    )[None, :]
    offs = r.to(tl.int64)[:, None] * n_cols + c[None, :]
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    s = tl.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    inv = tl.div_rn(1.0, s)
    y = tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + offs, y.to(tl.float8e4nv), mask=valid)
    tl.store(scale_ptr + pr * tl.num_programs(1) + pc, s)


@triton.jit
def _row_kernel(x_ptr, q_ptr, scale_ptr, n_cols, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * n_cols
    lanes = tl.arange(0, CHUNK)
    run = tl.zeros([CHUNK], tl.float32)
    for start in range(0, n_cols, CHUNK):
        offs = start + lanes
        x = tl.load(x_ptr + base + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        run = tl.maximum(run, tl.abs(x))
    amax = tl.max(run, axis=0)
    s = tl.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    inv = tl.div_rn(1.0, s)
    for start in range(0, n_cols, CHUNK):
        offs = start + lanes
        x = tl.load(x_ptr + base + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + base + offs, y.to(tl.float8e4nv), mask=offs < n_cols)
    tl.store(scale_ptr + row, s)


def available(device: torch.device) -> bool:
    """Whether the kernels run on this device: NVIDIA sm89+ (FP8 conversions in hardware) or AMD gfx950 (OCP FP8)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        return torch.cuda.get_device_properties(device).gcnArchName.startswith("gfx950")
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _tiles(x2: Tensor, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """Quantise a contiguous 2-D tensor per rows x cols tile: (q like x2, scale [ceil(R/rows), ceil(C/cols)])."""
    n_rows, n_cols = x2.shape
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(n_cols, cols))
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty(grid, dtype=torch.float32, device=x2.device)
    ROWS, COLS = triton.next_power_of_2(rows), triton.next_power_of_2(cols)
    warps = 8 if ROWS * COLS >= 8192 else 4
    _tile_kernel[grid](
        x2,
        q,
        scale,
        n_rows,
        n_cols,
        rows,
        cols,
        ROWS=ROWS,
        COLS=COLS,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return q, scale


def _rows(x2: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise a contiguous 2-D tensor per row: (q like x2, scale [R, 1])."""
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x2.device)
    if x2.shape[0] > 0:
        _row_kernel[(x2.shape[0],)](
            x2, q, scale, x2.shape[1], CHUNK=CHUNK, num_warps=4, enable_fp_fusion=False
        )
    return q, scale


def quantize_weight_triton(w: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """`fp8.quantize_weight` on CUDA: the same bytes and scales as the torch reference."""
    w2 = w.contiguous()
    if layout == "fp8_row":
        return _rows(w2)
    return _tiles(w2, BLOCK, BLOCK)


def quantize_activation_triton(x: Tensor, group: int | None) -> tuple[Tensor, Tensor]:
    """`fp8.quantize_activation` on CUDA: per token, or per 1 x group; the same bytes as the torch reference."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    q, s = _rows(x2) if group is None else _tiles(x2, 1, group)
    return q.view(*lead, k), s.view(*lead, s.shape[-1])


def block_mm(x2: Tensor, q: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor | None:
    """x2 [M, K] @ dequant(q [N, K], 128x128 scale_inv).T by the blockwise scaled GEMM, or None.

    Activations are quantised per 1x128 group (the contract's `quantize_activation(x, 128)`). The
    scales take the strides cuBLASLt wants: scale_a [M, K/128] column-major; scale_b the weight's
    [N/128, K/128] scales transposed to [K/128 rounded up to 4, N/128], column-major.
    """
    from torch.nn.functional import ScalingType, scaled_mm

    key = (x2.device.type, x2.device.index)
    if key in _BLOCK_MM_REFUSED or torch.version.hip is not None:
        return None
    if torch.cuda.get_device_capability(x2.device)[0] != 9 or out_dtype != torch.bfloat16:
        return None
    if x2.shape[1] % BLOCK or q.shape[0] % BLOCK:  # whole blocks only: what cuBLASLt's recipe is built for
        return None
    qa, sa = quantize_activation_triton(x2, BLOCK)
    kb = scale_inv.shape[1]
    kb4 = -(-kb // 4) * 4
    sb = torch.zeros((scale_inv.shape[0], kb4), dtype=torch.float32, device=x2.device)
    sb[:, :kb] = scale_inv
    try:
        return scaled_mm(
            qa,
            q.t(),
            sa.t().contiguous().t(),
            ScalingType.BlockWise1x128,
            sb.t(),
            ScalingType.BlockWise128x128,
            output_dtype=out_dtype,
        )
    except (RuntimeError, NotImplementedError, ValueError):
        _BLOCK_MM_REFUSED.add(key)
        return None
