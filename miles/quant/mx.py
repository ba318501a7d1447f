"""The Blackwell block formats, defined once: MXFP8 and NVFP4 (quantise and dequantise, torch reference).

MXFP8 (OCP Microscaling v1.0, E4M3 elements): blocks of 32 consecutive elements of the last dimension
share one E8M0 scale, a power of two chosen by the "floor" rule

    e     = floor(log2(max |x| over the block)) - 8            (8: the exponent of E4M3's largest, 448)
            (a block whose max is 0 or subnormal in fp32 counts as 2^-127)
    e     = clamp(e, -127, 128);  stored biased, e + 127, as uint8 (255: a block holding NaN)
    s     = max(2^e, 2^-126)
    q     = clamp(x / s, -448, 448) -> float8_e4m3fn (round to nearest even)
    x'    = q * s

NVFP4 (E2M1 elements, values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives): blocks of 16 share an
E4M3 scale, optionally under one fp32 per-tensor scale g:

    b     = max |x| over the block / 6
    s8    = clamp(b / g, 2^-6, 448) -> float8_e4m3fn           (g = 1 without a tensor scale; 2^-6:
                                                               E4M3's smallest normal)
    q     = E2M1(clamp(x * ((1 / g) / s8), -6, 6))               round to nearest, ties to the even code
    x'    = q * s8 * g

The element codes are 4 bits, sign in bit 3; two per byte, the first element in the low nibble. These
are the rules of torchao's reference (`prototype.mx_formats`: `to_mx` in its default floor mode,
`nvfp4_quantize`), which tests/unit/test_mx_formats.py checks bit for bit. On hardware without these
formats (everything but Blackwell) Miles only emulates them: quantise, then compute with x' in 16 or
32 bits. No speed figure is claimed for them.
"""

from __future__ import annotations

import torch
from torch import Tensor

MX_BLOCK = 32
NV_BLOCK = 16
E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8
E2M1_MAX = 6.0
E4M3_EPS = 2.0**-6
"""Smallest normal E4M3 value: NVFP4 block scales are clamped up to it."""
F32_MIN_NORMAL = 2.0**-126
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the E2M1 codes 0..7 (code | 8: the negative)."""


def _blocks(x: Tensor, block: int) -> Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of the block size {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


# ---- MXFP8 ------------------------------------------------------------------------------------------


def mxfp8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """(E8M0 scales as biased uint8 [..., n / 32], float8_e4m3fn elements [..., n])."""
    g = _blocks(x, MX_BLOCK)
    amax = g.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    e = torch.where(amax >= F32_MIN_NORMAL, exp - 1, torch.full_like(exp, -127)) - E4M3_MAX_POW2
    e = e.clamp(-127, 128)
    biased = torch.where(torch.isnan(amax), torch.full_like(e, 255), e + 127).to(torch.uint8)
    scale = _e8m0_value(biased)
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return biased, q.reshape(x.shape)


def _e8m0_value(biased: Tensor) -> Tensor:
    """2^(biased - 127) in fp32, at least the smallest normal fp32 (as the quantiser divides by)."""
    value = torch.ldexp(torch.ones_like(biased, dtype=torch.float32), biased.to(torch.int32) - 127)
    return torch.where(biased == 255, torch.full_like(value, float("nan")), value.clamp(min=F32_MIN_NORMAL))


def mxfp8_dequantize(scales: Tensor, q: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    g = q.float().reshape(*q.shape[:-1], q.shape[-1] // MX_BLOCK, MX_BLOCK)
    return (g * _e8m0_value(scales)[..., None]).reshape(q.shape).to(dtype)


# ---- NVFP4 ------------------------------------------------------------------------------------------


def _e2m1_codes(v: Tensor) -> Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 values already within [-6, 6]: nearest, ties to the even code."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    mag = v.abs()
    # the candidate below (largest value <= mag) and above; distances decide, ties go to the even code
    below = (torch.searchsorted(table, mag.contiguous(), right=True) - 1).clamp(0, 7)
    above = (below + 1).clamp(max=7)
    d_below, d_above = mag - table[below], table[above] - mag
    pick_above = (d_above < d_below) | ((d_above == d_below) & (above % 2 == 0) & (above != below))
    code = torch.where(pick_above, above, below)
    return (code | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)


def _e2m1_values(codes: Tensor) -> Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def pack_fp4(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte, the first in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def nvfp4_quantize(x: Tensor, tensor_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(float8_e4m3fn block scales [..., n / 16], packed E2M1 codes uint8 [..., n / 2])."""
    g = _blocks(x, NV_BLOCK)
    block_scale = g.abs().amax(dim=-1) / E2M1_MAX
    if tensor_scale is None:
        s8 = block_scale.clamp(E4M3_EPS, E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = g * (1.0 / s8.float())[..., None]
    else:
        s8 = (block_scale / tensor_scale).clamp(E4M3_EPS, E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = g * ((1.0 / tensor_scale) / s8.float())[..., None]
    codes = _e2m1_codes(scaled.clamp(-E2M1_MAX, E2M1_MAX).reshape(x.shape))
    return s8, pack_fp4(codes)


def nvfp4_dequantize(
    scales: Tensor, packed: Tensor, tensor_scale: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    values = _e2m1_values(unpack_fp4(packed))
    g = values.reshape(*values.shape[:-1], values.shape[-1] // NV_BLOCK, NV_BLOCK)
    s = scales.float() * (1.0 if tensor_scale is None else tensor_scale.float())
    return (g * s[..., None]).reshape(values.shape).to(dtype)
