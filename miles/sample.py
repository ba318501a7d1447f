"""The unit of rollout data shared by rollout, buffer and trainer: one sampled trajectory.

Plain dataclasses with lists (no torch; MoE routed experts are one compact numpy array), so they
cross process boundaries as pickle and the config/launch side never needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    """How a trajectory ended."""

    COMPLETED = "completed"  # the model stopped (EOS / stop token)
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # dropped by a weight update in abort mode or by an abort request
    FAILED = "failed"  # the engine or the environment failed


@dataclass
class Sample:
    """One trajectory: prompt + response tokens and everything training needs about them."""

    group_id: int
    """Index of the prompt group (all samples of one prompt share it)."""
    index: int
    """Position inside the group."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """Per response token: 1 if the model produced it and it is trained on, 0 for tool/user/template tokens."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Per response token: log-prob under the engine that sampled it (0.0 where loss_mask is 0)."""
    reward: float = 0.0
    status: Status = Status.COMPLETED
    weight_versions: list[int] = field(default_factory=list)
    """Weight version of every response token span, one entry per token (in_place updates mix versions)."""
    prompt: str = ""
    response: str = ""
    answer: Any = None
    """Reference answer of the task, given to the reward function."""
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None
    """The engine's expert choice per position and MoE layer, or None (dense models, or not
    requested): a numpy integer array [len(tokens) - 1, num_hidden_layers * top_k] (row p: the
    experts that routed the token at position p, layer-major), uint8 or int16 where the expert ids
    allow. The trainer views it as [rows, num_hidden_layers, top_k] (miles/train/routing_replay.py)."""
    teacher_logprobs: list[float] = field(default_factory=list)
    """Per response token: log-prob under the distillation teacher (train.distill), else empty."""
    weight: float = 1.0
    """Trajectory weight: the share of its episode this sample carries, 1 / (trajectories the episode
    produced: sub-agents, compacted histories); the trainer's group statistics and loss normalisation
    count it instead of 1 (miles/train/losses/aggregate.py)."""
    teacher_topk: Any = None
    """train.distill.mode = topk_reverse_kl: the teacher's top-k at each response token, a pair of
    numpy arrays (ids int64, log-probs float32), each [response_length, top_k]; else None."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else 0
