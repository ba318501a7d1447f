"""The root of the typed configuration: one Plan holds every section of a run."""

from __future__ import annotations

from miles.config.base import Section
from miles.config.engine import EngineConfig
from miles.config.eval import EvalConfig
from miles.config.launch import LaunchConfig
from miles.config.model import ModelConfig
from miles.config.observe import ObserveConfig
from miles.config.rollout import RolloutConfig
from miles.config.train import TrainConfig
from miles.config.weights import WeightsConfig


class RunConfig(Section):
    """Identity and location of a run."""

    name: str = "default"
    """Run name; the run directory is <runs_root>/<name>."""
    runs_root: str = "runs"
    """Directory holding run directories (on the shared filesystem for Slurm runs)."""
    seed: int = 0
    """Seed of every random number generator in the run."""
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""


class Plan(Section):
    """Everything a run needs, resolved: what ran is exactly this (written as plan.yaml)."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    eval: EvalConfig = EvalConfig()
    train: TrainConfig = TrainConfig()
    weights: WeightsConfig = WeightsConfig()
    launch: LaunchConfig = LaunchConfig()
    observe: ObserveConfig = ObserveConfig()

    @property
    def run_dir(self) -> str:
        """The run directory (absolute after resolve())."""
        import os

        return os.path.join(self.run.runs_root, self.run.name)
