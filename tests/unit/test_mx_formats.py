"""MXFP8 and NVFP4 (miles/quant/mx.py) against torchao's reference implementation, bit for bit, and
the round trips of the packing."""

from __future__ import annotations

import pytest
import torch

from miles.quant import mx

mx_ref = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
nv_ref = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")


def _inputs(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 128, generator=g) * torch.logspace(-6, 4, 16)[:, None]
    x[0, :32] = 0.0  # a zero block
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 2)  # E2M1 ties
    x[2, 5] = 1e-40  # subnormal
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_matches_torchao_bit_for_bit(dtype) -> None:
    for seed in range(4):
        x = _inputs(seed, dtype)
        scales, q = mx.mxfp8_quantize(x)
        ref_scales, ref_q = mx_ref.to_mx(x.contiguous(), torch.float8_e4m3fn, 32)
        assert torch.equal(scales, ref_scales.view(torch.uint8).reshape(scales.shape))
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8).reshape(q.shape))
        back = mx.mxfp8_dequantize(scales, q)
        rel = ((back - x.float()).abs() / x.float().abs().clamp(min=1e-30))[x.float().abs() > 1e-30]
        assert float(rel.median()) < 0.07  # E4M3 keeps 3 mantissa bits


@pytest.mark.parametrize("tensor_scale", [None, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_matches_torchao_bit_for_bit(dtype, tensor_scale) -> None:
    for seed in range(4):
        x = _inputs(seed, dtype)
        ts = None if tensor_scale is None else torch.tensor(tensor_scale)
        scales, packed = mx.nvfp4_quantize(x, ts)
        ref_scales, ref_packed = nv_ref.nvfp4_quantize(x.contiguous(), 16, ts)
        assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8).reshape(scales.shape))
        assert torch.equal(packed, ref_packed.view(torch.uint8).reshape(packed.shape))


def test_e2m1_rounding_and_packing() -> None:
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0, -0.1, 0.0, 4.0, 1.5])
    codes = mx._e2m1_codes(v)
    assert mx._e2m1_values(codes).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0, -0.0, 0.0, 4.0, 1.5]
    assert torch.equal(mx.unpack_fp4(mx.pack_fp4(codes)), codes)
    assert int(mx.pack_fp4(torch.tensor([1, 2], dtype=torch.uint8))) == 0x21
