"""The FP8 quantisation contract shared by the trainer, the weight sync and the engine.

One quantiser produces the bytes; the engine stores the bytes it is sent and never re-quantises
them, so the trainer's fake-quant forward and the engine's FP8 weights hold the same values.

The maths (DeepSeek / SGLang convention, every op IEEE-rounded in fp32):

    amax = max |w| over a 128x128 block (fp8_block) or over an output row (fp8_row)
    s    = max(amax, 1e-10) / 448.0          stored as `weight_scale_inv` (fp32)
    inv  = 1.0 / s                           IEEE division, never an approximate reciprocal
    q    = clamp(w * inv, -448, 448).to(float8_e4m3fn)   (round to nearest even)
    w'   = q.float() * s                     dequantised value

Partial blocks at the edges (shapes not multiples of 128) take the amax of the elements they hold.
Two implementations that follow these steps op for op give identical bytes; a fused multiply-add,
an approximate division or `x / s` instead of `x * (1 / s)` changes a few bytes per million.
On CUDA the Triton kernels in `miles.quant.triton_fp8` give the same bytes as the torch reference
below (a test checks it over many shapes). Activations are quantised per token or per 1 x group
with the same formula, never per tensor (a per-tensor scale would make a sequence's bytes depend on
the other sequences in the batch).

Wire and checkpoint layout: a quantised `X.weight` travels with `X.weight_scale_inv`
(`scale_name`); which HF names are quantised is `is_quantized_name`.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.quant.contract import FP8_LAYOUTS

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1e-10
"""Smallest amax used for a scale, so an all-zero block gets a finite scale (and zero bytes)."""

Layout = Literal["fp8_block", "fp8_row"]
LAYOUTS = FP8_LAYOUTS

_QUANTIZED_NAME = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o|q_a|q_b|kv_b|kv|o_a|o_b)_proj"
    r"|self_attn\.kv_a_proj_with_mqa|mlp\.(?:gate|up|down)_proj)\.weight$"
)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown FP8 layout {layout!r}; known layouts: {', '.join(LAYOUTS)}")


def _check_weight(w: Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"FP8 weight quantisation takes a 2-D [out, in] tensor, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"FP8 weight quantisation takes a floating-point tensor, got {w.dtype}")


def _scale_from_amax(amax: Tensor) -> tuple[Tensor, Tensor]:
    """(s, inv) from an fp32 amax: s = max(amax, 1e-10) / 448, inv = 1 / s, both IEEE-rounded.

    Both divisions divide by a tensor: PyTorch's CUDA kernel turns `t / python_scalar` into a
    multiply by the scalar's reciprocal, which is not the IEEE quotient.
    """
    s = torch.clamp_min(amax, AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)
    return s, torch.ones_like(s) / s


def _to_fp8(scaled: Tensor) -> Tensor:
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _block_view(w32: Tensor, rows: int, cols: int) -> Tensor:
    """w32 zero-padded to whole blocks, viewed as [out_blocks, rows, in_blocks, cols]."""
    out_dim, in_dim = w32.shape
    ob, ib = -(-out_dim // rows), -(-in_dim // cols)
    padded = F.pad(w32, (0, ib * cols - in_dim, 0, ob * rows - out_dim))
    return padded.view(ob, rows, ib, cols)


def quantize_weight_torch(w: Tensor, layout: Layout) -> tuple[Tensor, Tensor]:
    """The torch reference of `quantize_weight` (vectorised; CPU or CUDA, no Triton)."""
    _check_layout(layout)
    _check_weight(w)
    w32 = w.detach().to(torch.float32)
    if layout == "fp8_row":
        s, inv = _scale_from_amax(w32.abs().amax(dim=1, keepdim=True))
        return _to_fp8(w32 * inv), s
    out_dim, in_dim = w32.shape
    blocks = _block_view(w32, BLOCK, BLOCK)
    s, inv = _scale_from_amax(blocks.abs().amax(dim=(1, 3)))
    q = _to_fp8(blocks * inv[:, None, :, None])
    q = q.view(s.shape[0] * BLOCK, s.shape[1] * BLOCK)[:out_dim, :in_dim].contiguous()
    return q, s


def quantize_weight(w: Tensor, layout: Layout) -> tuple[Tensor, Tensor]:
    """(q float8_e4m3fn [out, in], scale_inv fp32) of a 2-D weight, on w's device.

    scale_inv is [ceil(out/128), ceil(in/128)] for fp8_block and [out, 1] for fp8_row. Any float
    dtype is converted to fp32 first. On CUDA a Triton kernel gives the same bytes as the torch path.
    """
    _check_layout(layout)
    _check_weight(w)
    if w.is_cuda and w.numel() > 0:
        from miles.quant import triton_fp8

        if triton_fp8.available(w.device):
            return triton_fp8.quantize_weight_triton(w.detach(), layout)
    return quantize_weight_torch(w, layout)


def scale_shape(out_dim: int, in_dim: int, layout: Layout) -> tuple[int, int]:
    """Shape of the `weight_scale_inv` of an [out_dim, in_dim] weight."""
    return (out_dim, 1) if layout == "fp8_row" else (-(-out_dim // BLOCK), -(-in_dim // BLOCK))


def quantization_config(layout: Layout) -> dict[str, object]:
    """config.json's `quantization_config` of an FP8 checkpoint in this layout (SGLang/DeepSeek)."""
    _check_layout(layout)
    config: dict[str, object] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if layout == "fp8_block":
        config["weight_block_size"] = [BLOCK, BLOCK]
    return config


def _expand_scale(scale_inv: Tensor, shape: torch.Size, layout: Layout) -> Tensor:
    """The per-element scale of a weight of `shape` (fp32, same device as scale_inv)."""
    out_dim, in_dim = shape
    want = scale_shape(out_dim, in_dim, layout)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{layout} scale_inv for a {out_dim}x{in_dim} weight must be {list(want)}, "
            f"got {list(scale_inv.shape)}"
        )
    if layout == "fp8_row":
        return scale_inv.float()
    full = scale_inv.float().repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return full[:out_dim, :in_dim]


def dequantize_weight(
    q: Tensor, scale_inv: Tensor, layout: Layout, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """(q.float() * expanded scale_inv).to(dtype): the values the engine's FP8 weight stands for."""
    _check_layout(layout)
    out_dim, in_dim = q.shape
    whole = (out_dim // BLOCK, in_dim // BLOCK)
    if layout == "fp8_block" and (out_dim % BLOCK, in_dim % BLOCK) == (0, 0) and scale_inv.shape == whole:
        # whole blocks: broadcast the scales instead of expanding them (same products, less memory)
        blocks = q.float().view(whole[0], BLOCK, whole[1], BLOCK) * scale_inv.float()[:, None, :, None]
        return blocks.view(q.shape).to(dtype)
    return (q.float() * _expand_scale(scale_inv, q.shape, layout)).to(dtype)


class _FakeQuant(torch.autograd.Function):
    """Straight-through estimator: forward quantise -> dequantise, backward identity."""

    @staticmethod
    def forward(ctx, w: Tensor, layout: str) -> Tensor:  # type: ignore[override]
        q, s = quantize_weight(w, layout)  # type: ignore[arg-type]
        return dequantize_weight(q, s, layout, w.dtype)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def fake_quant(w: Tensor, layout: Layout) -> Tensor:
    """dequantize_weight(*quantize_weight(w, layout), layout, w.dtype) with an identity gradient.

    The value is exactly the engine's weight (an autograd Function, not `w + (dq - w).detach()`,
    which rounds twice in low precision and can differ from dq).
    """
    _check_layout(layout)
    return _FakeQuant.apply(w, layout)


def quantize_activation_torch(x: Tensor, group: int | None = None) -> tuple[Tensor, Tensor]:
    """The torch reference of `quantize_activation`."""
    if group is not None and group <= 0:
        raise ValueError(f"activation quantisation group must be positive, got {group}")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x32 = x.detach().to(torch.float32).reshape(-1, k)
    if group is None:
        s, inv = _scale_from_amax(x32.abs().amax(dim=1, keepdim=True))
        return _to_fp8(x32 * inv).view(*lead, k), s.view(*lead, 1)
    groups = _block_view(x32, 1, group)  # [tokens, 1, groups, group]
    s, inv = _scale_from_amax(groups.abs().amax(dim=(1, 3)))
    q = _to_fp8(groups * inv[:, None, :, None]).view(x32.shape[0], -1)[:, :k].contiguous()
    return q.view(*lead, k), s.view(*lead, s.shape[-1])


def quantize_activation(x: Tensor, group: int | None = None) -> tuple[Tensor, Tensor]:
    """(q float8_e4m3fn like x, scale fp32): per token ([..., 1]) or per 1 x group ([..., ceil(K/group)]).

    Never per tensor. On CUDA a fused Triton kernel gives the same bytes as the torch path.
    """
    if x.is_cuda and x.numel() > 0:
        from miles.quant import triton_fp8

        if triton_fp8.available(x.device):
            return triton_fp8.quantize_activation_triton(x.detach(), group)
    return quantize_activation_torch(x, group)


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether this device runs e4m3fn GEMMs: CPU (torch's reference kernel), NVIDIA sm89+, AMD gfx950.

    MI300 (gfx942) computes in the fnuz variant of FP8, whose bytes mean other values: not covered.
    """
    if device.type == "cpu":
        return hasattr(torch, "_scaled_mm")
    if device.type != "cuda":
        return False
    if torch.version.hip is not None:
        return torch.cuda.get_device_properties(device).gcnArchName.startswith("gfx950")
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _rowwise_mm(x2: Tensor, q: Tensor, s_row: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x2 [M, K] @ dequant(q [N, K], s_row [N, 1]).T with activations quantised per token."""
    qa, sa = quantize_activation(x2)
    return torch._scaled_mm(qa, q.t(), scale_a=sa, scale_b=s_row.view(1, -1), out_dtype=out_dtype)


def fp8_linear(
    x: Tensor, q: Tensor, scale_inv: Tensor, layout: Layout, bias: Tensor | None = None, *, min_tokens: int
) -> Tensor:
    """y = x @ W.T + bias with W = dequantize_weight(q, scale_inv, layout), in x.dtype.

    With at least `min_tokens` rows (prefill, large batches), bf16 activations, a weight whose dims
    are multiples of 16 and a device with FP8 GEMMs, a real FP8 GEMM runs. fp8_row: activations
    quantised per token, `torch._scaled_mm` with row-wise scales (scale_a [M, 1], scale_b [1, N]),
    on CUDA and on CPU. fp8_block on CUDA: activations per 1x128 group and cuBLASLt's blockwise
    GEMM where PyTorch offers it (sm90; see `miles.quant.triton_fp8.block_mm`); elsewhere, and on
    CPU, the block-layout weight is dequantised and multiplied in x.dtype (correct, not faster).
    Below `min_tokens` (decode) the weight is dequantised and F.linear runs in x.dtype: FP8 GEMMs
    were measured slower than bf16 there at 0.5-1.5B. The bias is added in x.dtype after the GEMM.
    """
    _check_layout(layout)
    k = x.shape[-1]
    if q.dim() != 2 or q.shape[1] != k:
        raise ValueError(f"fp8_linear: input has {k} features but the weight is {tuple(q.shape)}")
    tokens = x.numel() // max(k, 1)
    n = q.shape[0]
    shapes_ok = tokens > 0 and k % 16 == 0 and n % 16 == 0 and x.dtype == torch.bfloat16
    fast = tokens >= min_tokens and shapes_ok
    if fast and scaled_mm_supported(x.device):
        x2 = x.reshape(-1, k)
        y = None
        if layout == "fp8_row":
            y = _rowwise_mm(x2, q, scale_inv, x.dtype)
        elif x.is_cuda:
            from miles.quant import triton_fp8

            y = triton_fp8.block_mm(x2, q, scale_inv, x.dtype)
        if y is not None:
            y = y.view(*x.shape[:-1], n)
            return y + bias.to(y.dtype) if bias is not None else y
    w = dequantize_weight(q, scale_inv, layout, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def is_quantized_name(name: str) -> bool:
    """Whether an HF parameter name is covered by the contract (dense attention and MLP projections).

    Covered: model.layers.N.self_attn.{q,k,v,o}_proj.weight, the latent attention's projections
    (self_attn.{q_a,q_b,kv_b}_proj and kv_a_proj_with_mqa, DeepSeek-V3), DeepSeek-V4's attention
    projections (self_attn.{q_a,q_b,kv,o_a,o_b}_proj; its compressors and indexer stay in the model
    dtype, as its checkpoints ship them) and model.layers.N.mlp.{gate,up,down}_proj.weight.
    Never embeddings, lm_head, norms, biases, the MoE router (mlp.gate.weight) or MoE experts
    (mlp.experts.*, mlp.shared_expert.*): they stay in the model dtype.
    """
    return _QUANTIZED_NAME.match(name) is not None


def scale_name(name: str) -> str:
    """The scale tensor's name of a quantised weight: "X.weight" -> "X.weight_scale_inv"."""
    if not name.endswith(".weight"):
        raise ValueError(f"only a '.weight' tensor has an FP8 scale, got {name!r}")
    return name + "_scale_inv"
