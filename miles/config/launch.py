"""Where and how the job's processes are placed: local host or a Slurm allocation."""

from __future__ import annotations

from typing import Literal

from miles.config.base import Section


class LaunchConfig(Section):
    """Placement of roles on nodes (used by `miles submit`; local runs ignore node counts)."""

    profile: str = "local"
    """Hardware profile name (profiles/<name>.yaml)."""
    layout: Literal["disaggregated", "colocated"] = "disaggregated"
    """`disaggregated`: a rollout node group and an actor node group (one het job); `colocated`: one group."""
    rollout_nodes: int = 1
    """Nodes of the rollout group."""
    actor_nodes: int = 1
    """Nodes of the actor (trainer) group."""
    time_limit_min: int = 60
    """Slurm time limit in minutes."""
