"""The INT4 (W4A16) weight contract: one definition of the quantiser, its packing and its checkpoint format.

Weights are quantised per group of `group_size` consecutive input columns of each output row (32 or
128), symmetric, without a zero point, the activations staying in 16 bits:

    s  = max(max |w| over the group, 1e-5) / 7        one per (row, group): `weight_scale`, rounded
                                                       to the scale dtype (the weight's: bf16 or fp32)
    q  = clamp(round(w / s), -7, 7)                    int8 values, round half to even (torch.round)
    w' = q * s                                         the dequantised weight

so a group takes at most 15 levels, |w - w'| <= s / 2, and q(w') = w' (the quantiser is idempotent:
the largest |w'| of a group is 7 s exactly, so the scale it gives back is s). The fake-quant forward
used in quantisation-aware training computes with w' and passes the gradient straight through
(d w' / d w = 1).

Checkpoint and wire layout: compressed-tensors' `pack-quantized` format (num_bits 4, strategy group,
symmetric, no activation quantisation). `X.weight` [out, in] becomes

    X.weight_packed  int32 [out, in / 8]   eight 4-bit values per word, value j of a word in bits
                                           4j .. 4j+3, each stored as q + 8 (0..15)
    X.weight_scale   [out, in / group_size] the scales, in the checkpoint's dtype
    X.weight_shape   int64 [2]              (out, in)

and the model config gains `quantization_config` (`quantization_config(...)`); the compressed-tensors
package reads these tensors back bit-exactly (tests/unit/test_int4.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

QMAX = 7
"""Largest quantised magnitude: values are clamped to [-7, 7] (15 levels, symmetric)."""
SCALE_FLOOR = 1e-5
"""Smallest group maximum used for a scale, so an all-zero group gets a finite scale (and zeros)."""
GROUP_SIZES = (32, 128)
PER_WORD = 8
"""4-bit values per int32 word of the packed layout."""


def _groups(w: Tensor, group_size: int) -> Tensor:
    if w.ndim != 2:
        raise ValueError(f"int4 quantises 2-D weights [out, in]; got shape {tuple(w.shape)}")
    if w.shape[1] % group_size:
        raise ValueError(
            f"int4 group_size {group_size} does not divide the input dimension {w.shape[1]}; "
            f"pick a group size among {GROUP_SIZES} that does, or leave this layer unquantised"
        )
    return w.float().reshape(w.shape[0], w.shape[1] // group_size, group_size)


def quantize(
    w: Tensor, group_size: int = 128, scale_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """(q int8 [out, in], scale [out, in / group_size]) of a weight (module docstring). The scale is
    rounded to `scale_dtype` (default: w's dtype) before q is computed from it, so a checkpoint that
    stores the scale in that dtype holds exactly the values the fake-quant forward used; it is
    returned as fp32 holding those values."""
    g = _groups(w, group_size)
    scale = (g.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / QMAX).to(scale_dtype or w.dtype).float()
    q = torch.round(g / scale[..., None]).clamp(-QMAX, QMAX)
    return q.reshape(w.shape).to(torch.int8), scale


def dequantize(q: Tensor, scale: Tensor, group_size: int = 128, dtype: torch.dtype = torch.float32) -> Tensor:
    """w' = q * s, in `dtype`."""
    g = q.float().reshape(q.shape[0], q.shape[1] // group_size, group_size)
    return (g * scale.float()[..., None]).reshape(q.shape).to(dtype)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: Tensor, group_size: int) -> Tensor:
        q, scale = quantize(w, group_size)
        return dequantize(q, scale, group_size, w.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def fake_quant(w: Tensor, group_size: int = 128) -> Tensor:
    """The dequantised weight w' in w's dtype, with the identity as its gradient (straight-through)."""
    return _FakeQuant.apply(w, group_size)


def pack(q: Tensor) -> Tensor:
    """int8 values in [-8, 7], [out, in] with in % 8 == 0 -> int32 words [out, in / 8]."""
    if q.dtype != torch.int8 or q.ndim != 2 or q.shape[1] % PER_WORD:
        raise ValueError(
            f"pack takes int8 [out, in] with in divisible by {PER_WORD}; got {q.dtype} {tuple(q.shape)}"
        )
    nibbles = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, PER_WORD)
    shifts = torch.arange(0, 4 * PER_WORD, 4, dtype=torch.int64, device=q.device)
    words = (nibbles << shifts).sum(dim=-1)  # 0 .. 2^32 - 1
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack(packed: Tensor, shape: tuple[int, int] | torch.Size) -> Tensor:
    """int32 words [out, in / 8] -> int8 values [out, in] (the inverse of `pack`).

    Read as little-endian bytes (byte b of a word holds values 2b and 2b + 1 in its low and high
    nibble), which is the word layout on every platform torch runs on."""
    data = packed.contiguous().view(torch.uint8)  # [out, in / 2]
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(packed.shape[0], -1)
    out, cols = int(shape[0]), int(shape[1])
    return nibbles[:out, :cols].to(torch.int8) - 8


def compress(
    name: str, w: Tensor, group_size: int = 128, scale_dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The pack-quantized tensors of HF weight `name` (`X.weight`): X.weight_packed, X.weight_scale,
    X.weight_shape. The scale is stored in `scale_dtype` (default: w's dtype, as compressed-tensors does)."""
    if not name.endswith(".weight"):
        raise ValueError(f"int4 compresses `*.weight` tensors; got {name!r}")
    base = name[: -len(".weight")]
    q, scale = quantize(w, group_size, scale_dtype)
    return {
        f"{base}.weight_packed": pack(q),
        f"{base}.weight_scale": scale.to(scale_dtype or w.dtype),
        f"{base}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


def decompress(
    tensors: dict[str, Tensor], base: str, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> Tensor:
    """X.weight (dequantised) from the pack-quantized tensors of `base` (= "X")."""
    shape = tuple(int(x) for x in tensors[f"{base}.weight_shape"].tolist())
    q = unpack(tensors[f"{base}.weight_packed"], shape)
    return dequantize(q, tensors[f"{base}.weight_scale"], group_size, dtype)


def quantization_config(
    group_size: int = 128, targets: list[str] | None = None, ignore: list[str] | None = None
) -> dict[str, Any]:
    """The `quantization_config` of an HF config.json for this format (compressed-tensors' schema):
    `targets` are module class names or `re:` patterns of the quantised layers (default: every Linear),
    `ignore` those left in 16 bits (default: the LM head)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES} (got {group_size})")
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": targets or ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore if ignore is not None else ["lm_head"],
    }
