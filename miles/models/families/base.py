"""What a model family is: the facts that tell one decoder-only family from another."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("engine", "fsdp", "megatron")
"""The rooms that load a model: the embedded engine and the two trainers."""


class Unsupported(ValueError):
    """A room asked to load a family it does not load (`Family.refuse_unless`)."""


@dataclass(frozen=True)
class Family:
    """One family of causal LMs (a module of miles/models/families/)."""

    hf_arch: str
    """`architectures[0]` of its config.json, e.g. "Qwen3ForCausalLM"."""
    model_type: str
    """Its config's `model_type`, e.g. "qwen3"."""
    config_class: str
    """transformers' config class, e.g. "Qwen3Config" (`miles model init-tiny --arch MODEL_TYPE`)."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMS norms of q and k before RoPE (Qwen3)."""
    moe: bool = False
    """Sparse layers of routed experts (miles/engine/moe.py reads their shape from the config)."""
    attention: str = "gqa"
    """The attention of its layers: `gqa` (grouped-query heads over a K/V cache), `mla` (multi-head
    latent attention over a cache of one latent per token), `deepseek_v4` (sliding window plus
    compressed and sparse-compressed caches)."""
    backends: tuple[str, ...] = BACKENDS
    """The rooms of BACKENDS that load it; the others refuse it when a plan is resolved."""
    packs: bool = True
    """transformers' forward keeps sequences packed into one row apart (the block-diagonal mask of
    restarting position_ids); False (DeepSeek-V4, whose compressors pool across the row): the FSDP
    trainer gives each sequence a micro-batch of its own."""
    tiny: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Config keys of its tiny model (`miles model init-tiny`) over the common tiny sizes."""
    tiny_init: Callable[[Any, int], None] | None = field(default=None, hash=False, compare=False)
    """`tiny_init(model, seed)`: fills what transformers' random init leaves constant (routing tables,
    correction biases), so a tiny model takes every path of the family."""

    def attention_names(self, prefix: str) -> list[str]:
        """HF names of one layer's attention tensors beyond q/k/v/o weights (`prefix`: `model.layers.i.`)."""
        names = [prefix + f"self_attn.{x}_proj.bias" for x in "qkv"] if self.qkv_bias else []
        if self.qk_norm:
            names += [prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"]
        return names

    def refuse_unless(self, backend: str) -> None:
        """Unsupported (a ValueError) naming the family, `backend` and the rooms that do load it, unless
        `backend` does."""
        if backend not in self.backends:
            raise Unsupported(
                f"{backend} cannot load {self.hf_arch} (model_type {self.model_type}); "
                f"what loads it: {', '.join(self.backends)}"
            )
