"""Loading a Hugging Face model into FSDP2: each decoder layer, then the root, wrapped with `fully_shard`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def causal_lm(path: str) -> nn.Module:
    """The HF causal LM at `path`, in fp32, with torch's SDPA attention where its class has it
    (DeepSeek-V4's has its own attention only)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def load_sharded(
    path: str,
    device: torch.device,
    compute_dtype: torch.dtype,
    trainable: bool,
    prepare: Callable[[nn.Module], Any] | None = None,
    build: Callable[[str], nn.Module] = causal_lm,
    freeze: Callable[[nn.Module], Any] | None = None,
) -> nn.Module:
    """`build(path)` (default: the causal LM), moved to `device`, `prepare` applied (e.g. the
    fake-quant forward of miles/train/quant.py), then sharded: with a bf16 `compute_dtype` FSDP keeps
    fp32 master weights, computes in bf16 and reduces gradients in fp32. The units are the module
    types the model lists in `_no_split_modules` (its decoder layers)."""
    model = build(path)
    model.to(device)
    if prepare is not None:
        prepare(model)
    model.requires_grad_(trainable)
    if trainable and freeze is not None:  # e.g. LoRA: only the adapter trains
        freeze(model)
    model.train(trainable)
    mp = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32
    )
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model
