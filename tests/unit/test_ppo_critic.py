"""PPO's critic in the FSDP backend (one rank, real gloo group): warm-up leaves the policy
bit-identical, the critic learns the returns, PPO raises the rewarded response, metrics, and the
critic's checkpoint and resume."""

from __future__ import annotations

import math

import pytest
import torch

from miles.cluster.distributed import teardown_distributed
from miles.config import resolve
from miles.sample import Sample
from miles.train import get_backend
from miles.train.checkpoint import CheckpointError

PROMPT = [11, 22, 33, 44]
GOOD, BAD = [50, 60, 70, 80], [90, 100, 110]
# a two-turn episode: policy tokens, a tool's output (mask 0), policy tokens again
TURNS, TURNS_MASK = [50, 60, 7, 8, 9, 70], [1, 1, 0, 0, 0, 1]


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    yield
    teardown_distributed()


def _backend(tiny_model: str, run_dir, **train):
    plan = resolve(
        {
            "model": {"path": tiny_model},
            "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
            "train": {
                "device": "cpu",
                "steps": 8,
                "loss": {"advantage": "ppo", "old_logprobs": "recompute"},
                **train,
            },
        }
    )
    backend = get_backend("fsdp")()
    backend.setup(plan)
    return backend


def _samples() -> list[Sample]:
    def s(i: int, resp: list[int], mask: list[int], reward: float) -> Sample:
        return Sample(0, i, PROMPT, resp, mask, [-2.0] * len(resp), reward=reward)

    return [s(0, GOOD, [1] * 4, 1.0), s(1, BAD, [1] * 3, 0.0), s(2, TURNS, TURNS_MASK, 1.0)]


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in module.named_parameters()}  # fmt: skip


def _policy_logprobs(backend, resp: list[int]) -> float:
    from miles.train.batching import pack

    sample = Sample(0, 0, PROMPT, resp, [1] * len(resp), [0.0] * len(resp))
    with torch.no_grad():
        logp, *_ = backend._forward(backend.model, pack([sample], [0]))
    return float(logp.sum())


@pytest.mark.slow
def test_warmup_trains_the_critic_only_then_ppo_learns(tiny_model, tmp_path) -> None:
    backend = _backend(tiny_model, tmp_path / "run", lr=3e-3, critic={"lr": 1e-2, "warmup_steps": 2})
    policy0, critic0 = _params(backend.model), _params(backend.critic.model)
    good0, bad0 = _policy_logprobs(backend, GOOD), _policy_logprobs(backend, BAD)
    losses = []
    for _ in range(2):
        m = backend.train(_samples())
        losses.append(m["critic/value_loss"])
        assert m["critic/warmup"] == 1.0 and m["grad_norm"] == 0.0
    # the policy is bit-identical after the warm-up; the critic moved and fits the returns better
    after = _params(backend.model)
    assert all(torch.equal(policy0[n], after[n]) for n in policy0)
    assert any(not torch.equal(critic0[n], t) for n, t in _params(backend.critic.model).items())
    assert losses[1] < losses[0]
    # first step: values 0, returns = rewards on every trained token (gamma = lam = 1): 7 tokens of
    # return 1 (GOOD's 4, the episode's 3) among 10 trained; the loss from V = 0 is 1/2 * 7/10
    first = _first_metrics(tiny_model, tmp_path)
    assert first["critic/values_mean"] == 0.0
    assert first["critic/returns_mean"] == pytest.approx(7 / 10)
    assert first["critic/value_loss"] == pytest.approx(0.5 * 7 / 10, rel=1e-5)
    assert first["critic/clipfrac"] == 0.0 and math.isnan(first["critic/explained_variance"]) is False
    for _ in range(4):
        m = backend.train(_samples())
        assert m["critic/warmup"] == 0.0 and m["grad_norm"] > 0
        assert {"critic/explained_variance", "critic/clipfrac", "critic/lr"} <= set(m)
    assert _policy_logprobs(backend, GOOD) > good0 + 0.05
    assert _policy_logprobs(backend, BAD) < bad0 - 0.05


def _first_metrics(tiny_model, tmp_path) -> dict[str, float]:
    fresh = _backend(tiny_model, tmp_path / "fresh", critic={"value_clip": None})
    return fresh.train(_samples())


@pytest.mark.slow
def test_critic_checkpoint_and_resume(tiny_model, tmp_path) -> None:
    backend = _backend(tiny_model, tmp_path / "run", critic={"lr": 1e-2})
    backend.train(_samples())
    backend.save(1, extra={"pos": 1})
    saved = _params(backend.critic.model)
    lr = backend.critic.optimizer.param_groups[0]["lr"]
    backend.train(_samples())
    assert any(not torch.equal(saved[n], t) for n, t in _params(backend.critic.model).items())
    assert (tmp_path / "run" / "checkpoints" / "step_1" / "critic" / "state").is_dir()

    resumed = _backend(tiny_model, tmp_path / "run", critic={"lr": 1e-2})
    assert resumed.load() == {"pos": 1}
    assert all(torch.equal(saved[n], t) for n, t in _params(resumed.critic.model).items())
    assert resumed.critic.optimizer.state and resumed.critic.optimizer.param_groups[0]["lr"] == lr
    # the next step of the resumed run equals the next step of the original
    a, b = backend, resumed
    a.load(1)
    ma, mb = a.train(_samples()), b.train(_samples())
    assert ma["critic/value_loss"] == pytest.approx(mb["critic/value_loss"], rel=1e-6)

    # a GRPO checkpoint has no critic: a PPO run refuses it with a message naming the key
    grpo = get_backend("fsdp")()
    grpo.setup(resolve({"model": {"path": tiny_model}, "run": {"runs_root": str(tmp_path), "name": "g"},
                        "train": {"device": "cpu"}}))  # fmt: skip
    grpo.save(1)
    ppo = _backend(tiny_model, tmp_path / "g")
    with pytest.raises(CheckpointError, match="advantage=ppo"):
        ppo.load()
