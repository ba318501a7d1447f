"""Where and how the job's processes are placed: local host or a Slurm allocation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles.config.base import Section


class SglangLaunchConfig(Section):
    """Server flags for `engine.kind: sglang` beyond the engine section (rendered by miles.rollout.sglang)."""

    context_length: int | None = None
    """--context-length: prompt + response tokens one request may hold (None: the model's)."""
    capture_routed_experts: bool = False
    """Record the experts each token was routed to and return them (--enable-return-routed-experts);
    on by itself with train.routing_replay=rollout."""
    extra_args: list[str] = Field(default_factory=list)
    """Further launch_server flags, passed through verbatim."""


class LaunchConfig(Section):
    """Placement of roles on nodes (used by `miles submit`; local runs ignore node counts)."""

    profile: str = "local"
    """Hardware profile name (profiles/<name>.yaml)."""
    layout: Literal["disaggregated", "colocated"] = "disaggregated"
    """`disaggregated`: engines and trainer ranks on their own GPUs (on Slurm: a rollout node group and an
    actor node group, one het job); `colocated`: they share the GPUs (one group); with `rollout.schedule=sync`
    the engines release their memory while the trainer trains, with `async` both stay resident."""
    rollout_nodes: int = 1
    """Nodes of the rollout group."""
    actor_nodes: int = 1
    """Nodes of the actor (trainer) group (the whole job when colocated)."""
    actor_tasks_per_node: int | None = None
    """Trainer ranks per node (default: the profile's GPUs per node, 1 on CPU-only profiles)."""
    cpus_per_task: int | None = None
    """CPUs of each trainer rank's Slurm task (--cpus-per-task; its intra-op threads follow); default:
    the profile's cpus_per_node / actor_tasks_per_node. A rollout node's task gets the node's cores."""
    eval_nodes: int = 1
    """Nodes of the eval group: with `eval.mode=dedicated` (and eval.every_steps > 0) a disaggregated
    Slurm job gets a third het component running the `eval.num_engines` eval engines."""
    engines_per_node: int | None = None
    """Engine servers per rollout node (default: sglang GPUs per node / (tp*dp); embedded engine.num_engines)."""
    time_limit_min: int = 60
    """Slurm time limit in minutes."""
    partition: str | None = None
    """Slurm partition (default: the profile's)."""
    container_image: str | None = None
    """Container image for every step (default: the profile's)."""
    requeue: bool = True
    """On USR2 before the time limit: checkpoint, then requeue; the requeued job resumes by itself."""
    array_parallelism: int = 4
    """Sweeps as job arrays: points running at once (the %k of --array)."""
    sweep_tag: str | None = None
    """Tag shared by the points of one sweep (set by `miles sweep`)."""
    actor_module: str = "miles.loop"
    """Module the actor ranks run (`python -m MODULE --run-dir RUN_DIR --resume`)."""
    stop_grace_s: float = 120.0
    """Ctrl-C / SIGTERM of `miles train`: how long the trainer may take to write a checkpoint of the
    step it reached before everything is stopped (a second Ctrl-C stops at once)."""
    sglang: SglangLaunchConfig = SglangLaunchConfig()
