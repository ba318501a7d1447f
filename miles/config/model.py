"""What model is trained and served: a local Hugging Face directory, never a hub name."""

from __future__ import annotations

from typing import Literal

from miles.config.base import Section


class ModelConfig(Section):
    """The policy model."""

    path: str = "runs/models/tiny"
    """Directory with config.json, safetensors weights and a tokenizer (`miles model init-tiny DIR` makes one)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype for serving and for the trainer's compute (the optimizer keeps fp32 master weights)."""
    init_tiny_if_missing: bool = True
    """If `path` does not exist, create a tiny random model there first (used by the default recipe)."""
