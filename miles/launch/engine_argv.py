"""The embedded engine's model flags for a plan: its weight contract (miles/train/quant.py) and LoRA."""

from __future__ import annotations

from typing import Any

from miles.train.quant import engine_quant_argv


def engine_lora_argv(plan: Any) -> list[str]:
    """--enable-lora with room for the run's adapter (train.lora); none without LoRA training."""
    lora = plan.train.lora
    if lora is None:
        return []
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(lora.rank),
        "--lora-target-modules",
        *lora.target_modules,
        "--max-loras-per-batch",
        "4",
    ]


def engine_argv(plan: Any) -> list[str]:
    return engine_quant_argv(plan) + engine_lora_argv(plan)
