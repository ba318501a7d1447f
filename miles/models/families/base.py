"""What a model family is: the facts that tell one decoder-only family from another."""

from __future__ import annotations

from dataclasses import dataclass


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

    def attention_names(self, prefix: str) -> list[str]:
        """HF names of one layer's attention tensors beyond q/k/v/o weights (`prefix`: `model.layers.i.`)."""
        names = [prefix + f"self_attn.{x}_proj.bias" for x in "qkv"] if self.qkv_bias else []
        if self.qk_norm:
            names += [prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"]
        return names
