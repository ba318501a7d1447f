"""One training step's recipe, the same for both backends; each backend keeps only its forward,
backward and optimiser step.

    advantages(samples, plan)             the estimator over the step's groups (one value per sample;
                                          PPO's critic replaces them by per-token GAE advantages)
    mini_batches(n, plan, data_ranks)     train.mini_batches_per_step contiguous, balanced index ranges,
                                          at least `data_ranks` samples each (fewer mini-batches when the
                                          step has too few samples; none at all is a ConfigError)
    policy_trains(critic_steps, plan)     the critic round's gate: with a critic (advantage: ppo), the
                                          policy is updated once the critic has trained warmup_steps steps
    StepStats                             the step's named metric sums, accumulated over micro-batches,
                                          summed over ranks once, and turned into the step's metrics

A sample's trained tokens are its loss mask's ones (`batching.check_samples` has checked that the mask
covers the response).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from miles.config import ConfigError
from miles.sample import Sample
from miles.train.losses import get_estimator

LOSS_KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss")
"""Sums that are already weighted losses: a step reports their mean over its mini-batches."""
TOKEN_KEYS = ("kl", "entropy", "clip_frac", "tis_weight", "tis_clip_frac", "distill_reverse_kl")
"""Sums over trained tokens: a step reports them per trained token."""
SEQ_KEYS = ("tis_clip_seq_frac",)
"""Sums over sequences: a step reports them per trained sequence."""
MISMATCH_KEYS = ("mismatch_sum", "mismatch_tokens")
"""|logp_train - logp_rollout| summed over the measured tokens, and their count."""


def trained_tokens(sample: Sample) -> int:
    return sum(sample.loss_mask)


def advantages(samples: Sequence[Sample], plan: Any) -> list[float]:
    """Each sample's advantage by `train.loss.advantage` over its group (equal group_id)."""
    loss = plan.train.loss
    rewards = torch.tensor([float(s.reward) for s in samples])
    groups = torch.tensor([s.group_id for s in samples])
    counts = torch.tensor([float(trained_tokens(s)) for s in samples])
    weights = torch.tensor([float(s.weight) for s in samples])
    return get_estimator(loss.advantage).compute(rewards, groups, counts, loss, weights).tolist()


def mini_batches(n_samples: int, plan: Any, data_ranks: int = 1) -> list[list[int]]:
    """Index ranges of the step's mini-batches: `train.mini_batches_per_step` of them, or as many as
    give each of the `data_ranks` ranks a sample (a step of few samples takes fewer updates)."""
    requested = plan.train.mini_batches_per_step
    n_mini = min(requested, n_samples // data_ranks)
    if n_mini < 1:
        raise ConfigError(
            f"a step of {n_samples} samples cannot feed {data_ranks} data-parallel ranks: raise "
            "rollout.prompts_per_step or rollout.n_samples_per_prompt, or use fewer data-parallel ranks"
        )
    return [list(range(k * n_samples // n_mini, (k + 1) * n_samples // n_mini)) for k in range(n_mini)]


def policy_trains(critic_steps: int | None, plan: Any) -> bool:
    """Whether the policy is updated this step: always without a critic (`critic_steps` None), else
    once the critic has taken `train.critic.warmup_steps` steps before this one."""
    return critic_steps is None or critic_steps >= plan.train.critic.warmup_steps


class StepStats:
    """Named float64 sums of one step: LOSS_KEYS, TOKEN_KEYS, SEQ_KEYS and MISMATCH_KEYS."""

    KEYS = LOSS_KEYS + TOKEN_KEYS + SEQ_KEYS + MISMATCH_KEYS

    def __init__(self) -> None:
        self.values = torch.zeros(len(self.KEYS), dtype=torch.float64)

    def __getitem__(self, key: str) -> float:
        return float(self.values[self.KEYS.index(key)])

    def add(self, sums: dict[str, Tensor]) -> None:
        """Add a micro-batch's sums: the objective's (every key of LOSS_KEYS, TOKEN_KEYS, SEQ_KEYS) and,
        where given, MISMATCH_KEYS."""
        keys = [k for k in self.KEYS if k in sums or k not in MISMATCH_KEYS]
        index = torch.tensor([self.KEYS.index(k) for k in keys])
        self.values[index] += torch.stack([sums[k].detach().double() for k in keys]).cpu()

    def add_mismatch(self, logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> None:
        """Add the trained tokens' |logp - rollout_logp| and their count."""
        diff = (logp.detach().float() - rollout_logp.to(logp.device)).abs()
        mask = mask.to(logp.device)
        i = self.KEYS.index("mismatch_sum")
        self.values[i : i + 2] += torch.stack([(mask * diff).sum(), mask.sum()]).double().cpu()

    def reduce(self, all_reduce: Callable[[Tensor], Tensor]) -> None:
        """Sum over the trainer ranks (`all_reduce` returns the summed tensor)."""
        self.values = all_reduce(self.values)

    def metrics(self, updates: int, tokens: int, seqs: int, distill: bool) -> dict[str, float]:
        """The step's policy metrics: losses per update, token sums per trained token, sequence sums
        per trained sequence, and logprob_mismatch per measured token."""
        out = {k: self[k] / max(updates, 1) for k in LOSS_KEYS}
        out |= {k: self[k] / max(tokens, 1) for k in TOKEN_KEYS}
        out |= {k: self[k] / max(seqs, 1) for k in SEQ_KEYS}
        out["tis_weight_mean"] = out.pop("tis_weight")
        if not distill:
            out.pop("distill_reverse_kl")
        out["logprob_mismatch"] = self["mismatch_sum"] / max(self["mismatch_tokens"], 1.0)
        out["tokens"] = float(tokens)
        return out


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
