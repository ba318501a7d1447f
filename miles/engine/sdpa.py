"""Scaled dot-product attention with an explicit mask, as the engine's gather paths call it.

On CUDA, PyTorch 2.11 tries cuDNN's attention first for a call with an explicit mask, and cuDNN builds
an execution plan for every shape it has not seen, tens to hundreds of milliseconds each. An engine's
shapes change with nearly every call (the batch, the context length, the rows an MTP layer follows), so
those builds would land inside decode steps; the masked calls here leave cuDNN out and run flash,
memory-efficient or math attention, which need no plan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_PLANLESS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`, cuDNN left out on CUDA."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    with sdpa_kernel(_PLANLESS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
