"""Evaluation: when, on which prompts, with which sampling, on which engines."""

from __future__ import annotations

from miles.config.base import Section


class EvalConfig(Section):
    """Evaluation on held-out prompts, on the shared engines."""

    every_steps: int = 5
    """Evaluate every N training steps (and before the first); 0 turns evaluation off."""
    samples_per_prompt: int = 4
    """k of pass@k; pass@1 is the mean over these samples."""
    temperature: float = 0.0
    """Sampling temperature for evaluation (0: greedy, then pass@k = pass@1)."""
