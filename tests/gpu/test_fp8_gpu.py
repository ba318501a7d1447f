"""The FP8 contract's Triton kernels (miles/quant/triton_fp8.py) on a GPU with FP8 (sm89+).

Bytes and scales of the kernels must equal the torch reference (miles/quant/fp8.py, the path CPU
tensors take, itself checked against a per-block loop in tests/unit/test_fp8_contract.py) over many
shapes: weights per 128x128 block and per row, activations per token and per 1 x group, with
partial blocks, fp32 / bf16 / fp16 inputs and scales of random magnitude. Then fp8_linear's FP8
GEMMs (row-wise `torch._scaled_mm`; the blockwise GEMM where PyTorch offers it) against an fp32
GEMM on the dequantised values, and the decode path below `min_tokens`. Skipped without such a GPU.
"""

from __future__ import annotations

import pytest
import torch

from miles.quant import fp8


def _fp8_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    from miles.quant import triton_fp8

    return triton_fp8.available(torch.device("cuda"))


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 (sm89+ or gfx950)"),
]

WEIGHT_SHAPES = [(1, 1), (127, 129), (128, 128), (300, 1000), (896, 4864), (4864, 896), (8960, 1536)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weight(shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape, device="cuda", generator=gen)
    mag = 10.0 ** torch.empty(shape[0], 1, device="cuda").uniform_(-5, 2, generator=gen)
    w = w * mag
    if shape[0] > 128 and shape[1] > 128:
        w[:128, :128] = 0.0
        w[-1, -1] = 44800.0
    return w.to(dtype)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, s = got
    q_ref, s_ref = want
    assert q.is_cuda and s.is_cuda and q.dtype == fp8.FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    diff = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    assert diff == 0, f"{diff} of {q.numel()} bytes differ"
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


@pytest.mark.parametrize("layout", fp8.LAYOUTS)
@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_kernel_bytes_equal_the_reference(layout, shape, dtype) -> None:
    w = _weight(shape, dtype, seed=shape[0] * 3 + shape[1])
    got = fp8.quantize_weight(w, layout)  # the Triton kernel on CUDA
    _same(got, fp8.quantize_weight_torch(w, layout))  # torch ops on the same GPU
    q_cpu, s_cpu = fp8.quantize_weight(w.cpu(), layout)  # the CPU reference
    _same(got, (q_cpu.cuda(), s_cpu.cuda()))


@pytest.mark.parametrize("group", [None, 128, 100])
@pytest.mark.parametrize("shape", [(1, 896), (7, 4864), (4096, 896), (33, 18944), (2, 3, 1000)])
def test_activation_kernel_bytes_equal_the_reference(group, shape) -> None:
    gen = torch.Generator(device="cuda").manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    got = fp8.quantize_activation(x, group)
    _same(got, fp8.quantize_activation_torch(x, group))
    q_cpu, s_cpu = fp8.quantize_activation_torch(x.cpu(), group)
    _same(got, (q_cpu.cuda(), s_cpu.cuda()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _linear_problem(m: int, k: int, n: int, layout: str):
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.03
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    q, s = fp8.quantize_weight(w, layout)
    return x, q, s, bias, fp8.dequantize_weight(q, s, layout, torch.float32)


@pytest.mark.parametrize("mkn", [(2048, 896, 4864), (1024, 4864, 896), (512, 1536, 8960)])
def test_rowwise_scaled_mm_against_fp32(mkn) -> None:
    x, q, s, bias, w_dq = _linear_problem(*mkn, "fp8_row")
    y = fp8.fp8_linear(x, q, s, "fp8_row", bias, min_tokens=256)
    qa, sa = fp8.quantize_activation(x)
    ref = (qa.float() * sa) @ w_dq.T + bias.float()  # fp32 GEMM on the dequantised operands
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert _rel(y, ref) < 5e-3  # measured 1.7e-3 on one H200 (bf16 output rounding dominates)


@pytest.mark.parametrize("mkn", [(2048, 896, 4864), (1000, 4864, 896)])
def test_block_gemm_against_fp32(mkn) -> None:
    from miles.quant import triton_fp8

    x, q, s, bias, w_dq = _linear_problem(*mkn, "fp8_block")
    y = triton_fp8.block_mm(x, q, s, torch.bfloat16)
    if y is None:
        pytest.skip("no blockwise scaled GEMM here (PyTorch offers it on sm90 with cuBLASLt >= 12.9)")
    qa, sa = fp8.quantize_activation(x, 128)
    x_dq = (qa.float().view(x.shape[0], -1, 128) * sa[:, :, None]).view(x.shape)
    assert _rel(y, x_dq @ w_dq.T) < 5e-3
    full = fp8.fp8_linear(x, q, s, "fp8_block", bias, min_tokens=1)
    assert _rel(full, x_dq @ w_dq.T + bias.float()) < 5e-3


@pytest.mark.parametrize("layout", fp8.LAYOUTS)
def test_decode_path_below_min_tokens_is_dequantise_and_linear(layout) -> None:
    x, q, s, bias, w_dq = _linear_problem(16, 896, 4864, layout)
    y = fp8.fp8_linear(x, q, s, layout, bias, min_tokens=256)
    want = torch.nn.functional.linear(x, w_dq.to(torch.bfloat16), bias)
    assert torch.equal(y, want)
    assert _rel(y, x.float() @ w_dq.T + bias.float()) < 5e-3
