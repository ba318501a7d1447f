"""The step recipe both backends share (miles/train/step.py): mini-batches, the critic gate, advantages
and the step's named sums."""

from __future__ import annotations

import pytest
import torch

from miles.config import ConfigError, resolve
from miles.sample import Sample
from miles.train import step


def _plan(**train):
    return resolve({"train": train})


def test_mini_batches_are_contiguous_balanced_and_fewer_when_the_step_is_small() -> None:
    plan = _plan(mini_batches_per_step=3)
    assert step.mini_batches(10, plan) == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert step.mini_batches(2, plan) == [[0], [1]]  # two samples: two updates
    assert step.mini_batches(10, plan, data_ranks=4) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # >= 4 each
    with pytest.raises(ConfigError, match="cannot feed 4 data-parallel ranks"):
        step.mini_batches(3, plan, data_ranks=4)


def test_the_policy_waits_for_the_critic_warmup() -> None:
    plan = resolve({"train": {"critic": {"warmup_steps": 2}, "loss": {"advantage": "ppo"}}})
    assert step.policy_trains(None, plan)
    assert [step.policy_trains(n, plan) for n in range(4)] == [False, False, True, True]


def test_advantages_by_group() -> None:
    samples = [
        Sample(group_id=g, index=i, prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], reward=r)
        for i, (g, r) in enumerate([(0, 1.0), (0, 0.0), (1, 1.0), (1, 1.0)])
    ]
    adv = step.advantages(samples, _plan())
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0.0


def test_step_stats_name_their_sums_and_normalise_them() -> None:
    stats = step.StepStats()
    sums = {k: torch.tensor(2.0) for k in step.LOSS_KEYS + step.TOKEN_KEYS + step.SEQ_KEYS}
    stats.add(sums)
    stats.add(sums | {"mismatch_sum": torch.tensor(3.0), "mismatch_tokens": torch.tensor(6.0)})
    stats.reduce(lambda x: 2 * x)  # two ranks holding the same sums
    m = stats.metrics(updates=2, tokens=8, seqs=4, distill=False)
    assert m["loss"] == 4.0 and m["kl"] == 1.0 and m["tis_clip_seq_frac"] == 2.0
    assert m["logprob_mismatch"] == 0.5 and m["tokens"] == 8.0 and m["tis_weight_mean"] == 1.0
    assert "distill_reverse_kl" not in m and "tis_weight" not in m
