"""LoRA training in the FSDP backend (train.lora), with PEFT.

The causal LM is wrapped by `peft.get_peft_model` before sharding: every target linear layer gains
`lora_A` [r, in] and `lora_B` [out, r] (B starts at zero, so step 0 is the base model), the base
weights are frozen (`requires_grad=False`: no gradient, no optimiser state), and FSDP2 shards both.
The adapter leaves the trainer under PEFT's saved names (`base_model.model.<module>.lora_A.weight`):
what `/load_lora_adapter_from_tensors` takes and what `adapter_model.safetensors` holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from miles.train.fsdp.sharding import causal_lm


def peft_config(lora: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def adapter_config(lora: Any, base_path: str) -> dict[str, Any]:
    """The adapter_config.json of the run's adapter (PEFT's own serialisation of the config)."""
    cfg = peft_config(lora).to_dict()
    cfg["base_model_name_or_path"] = base_path
    cfg["target_modules"] = sorted(cfg["target_modules"])
    return cfg


def build(lora: Any):
    """A `build` for load_sharded: the causal LM with the run's adapter, base weights frozen."""

    def make(path: str) -> nn.Module:
        from peft import get_peft_model

        return get_peft_model(causal_lm(path), peft_config(lora))

    return make


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def freeze_base(model: nn.Module) -> int:
    """requires_grad only on the adapter; returns the trainable parameter count."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        n += p.numel() if p.requires_grad else 0
    return n


def saved_name(name: str) -> str:
    """PEFT's saved name of a parameter ('.default' adapter name dropped)."""
    return name.replace(".default.", ".")


def adapter_tensors(model: nn.Module, dtype: Any = None) -> Iterator[tuple[str, Tensor]]:
    """(saved name, full tensor) of every adapter parameter (collective under FSDP: every rank iterates)."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield saved_name(name), t if dtype is None else t.to(dtype)
