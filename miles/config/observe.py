"""Observation beyond metrics.jsonl: the optional Weights & Biases logger (TensorBoard: run.tensorboard)."""

from __future__ import annotations

from typing import Literal

from miles.config.base import Section


class WandbConfig(Section):
    """Weights & Biases logging of every metrics.jsonl record (needs the `wandb` extra)."""

    enabled: bool = False
    """Log each step's metrics to W&B beside metrics.jsonl (and TensorBoard when run.tensorboard)."""
    project: str = "miles"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); None: the account's default."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes the run under RUN_DIR/wandb only (upload later with `wandb sync`)."""
    group: str | None = None
    """Run group; None: the sweep tag (launch.sweep_tag) for sweep points, else no group."""
    tags: list[str] = []
    """Tags added to the W&B run."""


class ObserveConfig(Section):
    """Where a run's metrics go besides RUN_DIR/metrics.jsonl."""

    wandb: WandbConfig = WandbConfig()
    """Weights & Biases (off by default)."""
