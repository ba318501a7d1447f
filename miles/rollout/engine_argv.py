"""The embedded engine's model flags for a plan: its weight contract (miles/train/quant.py), LoRA and
speculative decoding."""

from __future__ import annotations

from typing import Any

from miles.quant.contract import engine_quant_argv


def lora_slots(lora: Any) -> int:
    """Adapter slots a LoRA run's engines keep: one per adapter it trains (every slot of the bank is
    multiplied at every step, so a bank no larger than needed decodes fastest: bench/RESULTS.md)."""
    return len(lora.names)


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
        str(lora_slots(lora)),
    ]


def engine_argv(plan: Any) -> list[str]:
    from miles.config.engine import speculative_argv

    return engine_quant_argv(plan) + engine_lora_argv(plan) + speculative_argv(plan)
