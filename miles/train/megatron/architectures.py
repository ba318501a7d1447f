"""The model architectures the Megatron backend trains, registered by the HF config's `model_type`.

An `Architecture` is everything the backend (backend.py), the checkpoint exporter (miles/export.py)
and a job's render need of a model that the backend does not know by itself: its TransformerConfig,
the module of one pipeline stage, how HF weights go in and come out, and what it cannot do. Two are
registered:

- `gpt` (the default, miles/train/megatron/gpt.py): megatron-core's GPTModel with the converted
  families of convert.py (Qwen2/Qwen3/Llama, Qwen3-MoE, DeepSeek-V3's latent attention);
- `deepseek_v4` (miles/train/megatron/deepseek_v4_model.py): Miles' own DeepSeek-V4 modules
  (hybrid attention, hyper-connections, hash and sqrtsoftplus routers) in `DeepseekV4GPT`.

The registry names where each lives (`REGISTRY`) and imports it on first use, so that resolving a
plan never imports megatron-core.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

REGISTRY: dict[str, str] = {
    "deepseek_v4": "miles.train.megatron.deepseek_v4_model:ARCHITECTURE",
}
"""HF `model_type` -> "module:attribute" of its Architecture; any other type is `DEFAULT`'s."""
DEFAULT = "miles.train.megatron.gpt:ARCHITECTURE"


@dataclass(frozen=True)
class Architecture:
    """What the Megatron backend builds, loads and exports for one kind of model."""

    name: str
    spec: str
    """Where its layers are specified (a module path), for renders and messages."""
    config: Callable[..., Any]
    """(hf_cfg, dtype, tp, pp, ep=, stage_layers=, extra=) -> the TransformerConfig."""
    build: Callable[[Any, Any], Any]
    """(hf_cfg, tf) -> this rank's pipeline stage (reads megatron-core's parallel state)."""
    load: Callable[[Any, dict, Any], None]
    """(stage, full HF state, hf_cfg): copy this rank's slice of the weights in."""
    export: Callable[..., Iterator[list]]
    """(stage, hf_cfg, bucket_bytes, contract) -> HF-named full tensors in buckets (collective)."""
    to_hf: Callable[..., dict]
    """(full state under global Megatron names, hf_cfg, te_names) -> HF names (a checkpoint's export)."""
    layer_offset: Callable[[Any], int]
    """A stage's first global layer, as its parameter names count layers (0: names are global)."""
    packs: Callable[[Any], bool]
    """Whether the stage takes several sequences packed into one row, for an HF config."""
    lacks: dict[str, str] = field(default_factory=dict)
    """train.* feature -> why this architecture does not have it (a plan using it is refused)."""


def spec_of(model_type: str | None) -> str:
    """ "module:attribute" of `model_type`'s Architecture."""
    return REGISTRY.get(model_type or "", DEFAULT)


def of(hf_cfg: Any) -> Architecture:
    """The registered Architecture of an HF config (by `model_type`)."""
    module, _, attr = spec_of(getattr(hf_cfg, "model_type", None)).partition(":")
    return getattr(importlib.import_module(module), attr)


def refusal(arch: Architecture, train: Any) -> str | None:
    """Why `train` (a plan's train section) asks what `arch` lacks, naming the key; None when it does not."""
    asked = {
        "lora": ("train.lora", train.lora is not None),
        "quantization": (f"train.quantization={train.quantization}", train.quantization != "none"),
        "critic": ("train.loss.advantage=ppo", train.loss.advantage == "ppo"),
        "tensor_parallel": (f"train.tensor_parallel={train.tensor_parallel}", train.tensor_parallel > 1),
        "recompute": (f"train.recompute={train.recompute}", train.recompute != "none"),
    }
    for key, (shown, used) in asked.items():
        if used and key in arch.lacks:
            return f"{shown} with train.backend=megatron and a {arch.name} model: {arch.lacks[key]}"
    return None
