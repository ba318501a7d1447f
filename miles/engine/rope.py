"""RoPE frequencies of the engine's decoders: default and YaRN (transformers' `rope_type: yarn`).

YaRN (arXiv 2309.00071), as transformers computes it for DeepSeek-V3's `rope_scaling` and
DeepSeek-V4's `compress` rope: with d the rotated dims, b the base, s the factor and L the original
context (`original_max_position_embeddings`),
    f_i = b^(-2i/d)  (extrapolation),  f_i / s  (interpolation)
    ramp over pair i between low = d log(L / (beta_fast 2 pi)) / (2 log b) and high (beta_slow),
    floored / ceiled unless `truncate` is false, clipped to [0, d - 1]
    inv_freq_i = f_i / s * ramp_i + f_i * (1 - ramp_i)
    cos and sin are multiplied by attention_factor = mscale(s, mscale) / mscale(s, mscale_all_dim)
    (or mscale(s) = 0.1 log s + 1 without both), where mscale(s, m) = 0.1 m log s + 1 (1 for s <= 1).
DeepSeek-V3's latent attention also multiplies its softmax scale by mscale(s, mscale_all_dim)^2
(`yarn_softmax_scale`).
"""

from __future__ import annotations

import math

import torch


def mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def frequencies(params: dict, dim: int, base: float, max_positions: int, truncate: bool = True):
    """(inv_freq [dim / 2] fp32, attention factor) of a rope's parameters (`rope_type` default or yarn);
    ValueError naming another type."""
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if kind == "default":
        return 1.0 / pos, 1.0
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (default and yarn are)")
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_positions / original)
    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attention)


def yarn_softmax_scale(params: dict, scale: float) -> float:
    """DeepSeek's softmax scale under YaRN: times mscale(factor, mscale_all_dim)^2 (module docstring)."""
    if (params.get("rope_type", params.get("type", "default")) or "default") != "default":
        m_all = params.get("mscale_all_dim", 0)
        if m_all:
            scale = scale * mscale(float(params["factor"]), m_all) ** 2
    return scale


def decoder_frequencies(spec, device) -> tuple[torch.Tensor, float]:
    """(inv_freq, cos/sin factor) of a ModelSpec's rope: its YaRN parameters when it has them (over the
    latent attention's RoPE dims for DeepSeek-V3), else the default rope over head_dim (in float64, as
    the engine always computed it)."""
    if spec.rope_scaling is None:
        half = torch.arange(0, spec.head_dim, 2, dtype=torch.float64, device=device) / spec.head_dim
        return (1.0 / spec.rope_theta**half).float(), 1.0
    dim = spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim
    inv, scale = frequencies(spec.rope_scaling, dim, spec.rope_theta, spec.max_position_embeddings)
    return inv.to(device), scale
