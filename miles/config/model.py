"""What model is trained and served: a local Hugging Face directory, never a hub name."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from miles.config.base import Section

TINY_SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "mlp_only_layers",
)


class TinyModelConfig(Section):
    """The tiny random model `model.init_tiny_if_missing` creates (miles/models/tiny.py)."""

    arch: Literal["qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v3", "deepseek_v4"] = "qwen2"
    """Model family (qwen3_moe: a mixture of experts, by default 4 experts, top-2, layer 0 dense)."""
    vocab_size: int = 384
    """Vocabulary of the locally trained BPE tokenizer."""
    corpus: Literal["default", "coding"] = "default"
    """Text the tokenizer is trained on: `coding` adds the procedural coding tasks' text and makes
    `<tool_call>` / `</tool_call>` single tokens (miles/models/tiny.py)."""
    pretrain_steps: int = Field(0, ge=0)
    """Causal-LM steps on the corpus's base text before the model is written: a base model instead of
    a random one (coding: shell sessions and comments, never a task's instruction or a tool call;
    under a minute for 1800 steps on 2 idle cores, 2.2-2.4 min at load 4-5). 0: random weights."""
    mtp: bool = False
    """Add a random multi-token-prediction layer (miles/models/mtp.py): the draft of
    engine.speculative.algorithm NEXTN, trained with the policy under train.draft."""
    sizes: dict[str, int | list[int]] = {}
    """Config sizes over the family's tiny defaults (hidden 64, 2 layers, 4 heads, ...), e.g.
    {hidden_size: 128}; `mlp_only_layers` is a list of layer indices."""

    @field_validator("sizes")
    @classmethod
    def _known_sizes(cls, sizes: dict) -> dict:
        unknown = sorted(set(sizes) - set(TINY_SIZE_KEYS))
        if unknown:
            raise ValueError(f"unknown tiny model size(s) {unknown}; known: {', '.join(TINY_SIZE_KEYS)}")
        return sizes


class ModelConfig(Section):
    """The policy model."""

    path: str = "runs/models/tiny"
    """Directory with config.json, safetensors weights and a tokenizer (`miles model init-tiny DIR` makes one)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype for serving and for the trainer's compute (the optimizer keeps fp32 master weights)."""
    init_tiny_if_missing: bool = True
    """If `path` does not exist, create the tiny random model `model.tiny` there first (the tiny
    recipes rely on it: each runs with one command from an empty runs root)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Architecture and sizes of that tiny model."""
    base_recipe: str | None = None
    """If `path` does not exist, `miles train` first runs this recipe in the same runs root and exports
    its last checkpoint to `path`: a base that has learnt something, for a run that adapts it
    (recipes/lora-tiny.yaml). A relative path is taken from the directory of the recipe that names it.
    Takes precedence over init_tiny_if_missing; `miles submit` does not run it (make the base first)."""
    base_overrides: list[str] = []
    """`KEY=VALUE` overrides of that base run (as `miles train --set`)."""
