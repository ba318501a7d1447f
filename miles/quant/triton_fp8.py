"""Triton kernels of the FP8 contract (CUDA); the first version defers to the torch reference."""

from __future__ import annotations

from torch import Tensor


def available() -> bool:
    """Whether the Triton kernels can run here."""
    return False


def quantize_weight_triton(w: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    raise NotImplementedError


def quantize_activation_triton(x: Tensor, group: int | None) -> tuple[Tensor, Tensor]:
    raise NotImplementedError


def block_mm(x2: Tensor, q: Tensor, scale_inv: Tensor, out_dtype) -> Tensor | None:
    """None: the caller dequantises the block-layout weight."""
    return None
