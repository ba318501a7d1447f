"""The FSDP backend in this process (one rank, real gloo group): the protocol, learning direction,
metrics that can be checked exactly, checkpoints in place, offload pairing and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from miles.cluster.distributed import teardown_distributed
from miles.config import resolve
from miles.sample import Sample
from miles.train import BACKENDS, get_backend
from miles.train.backend import TrainBackend
from miles.train.checkpoint import complete_steps

PROMPT = [11, 22, 33, 44]
GOOD, BAD = [50, 60, 70, 80], [90, 100, 110]


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    yield
    teardown_distributed()


def _backend(tiny_model: str, run_dir, **train):
    plan = resolve(
        {
            "model": {"path": tiny_model},
            "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
            "train": {"device": "cpu", "steps": 8, **train},
        }
    )
    backend = get_backend("fsdp")()
    backend.setup(plan)
    return backend


def _hf_logprobs(model, response: list[int]) -> list[float]:
    with torch.no_grad():
        logp = model(torch.tensor([PROMPT + response])).logits[0].log_softmax(-1)
    return [logp[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(response)]


def _group(model) -> list[Sample]:
    return [
        Sample(0, 0, PROMPT, GOOD, [1] * len(GOOD), _hf_logprobs(model, GOOD), reward=1.0),
        Sample(0, 1, PROMPT, BAD, [1] * len(BAD), _hf_logprobs(model, BAD), reward=0.0),
    ]


def _load_exported(backend, tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    model.load_state_dict({n: t for bucket in backend.export_weights(1 << 20) for n, t in bucket})
    return model


def test_registry_and_protocol(tiny_model) -> None:
    assert set(BACKENDS) == {"fsdp", "megatron"}
    with pytest.raises(ValueError, match="known: fsdp, megatron"):
        get_backend("deepspeed")
    assert isinstance(get_backend("fsdp")(), TrainBackend)


@pytest.mark.slow
def test_grpo_raises_the_rewarded_response_and_measures_no_mismatch(tiny_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    samples = _group(start)
    backend = _backend(
        tiny_model, tmp_path / "run", lr=3e-3, loss={"old_logprobs": "recompute", "tis": "mask"}
    )
    first = backend.train(samples)
    # rollout log-probs are the model's own: the trainer must agree with them exactly
    assert first["logprob_mismatch"] < 1e-5
    assert first["tis_weight_mean"] == pytest.approx(1.0) and first["tis_clip_frac"] == 0.0
    assert first["tokens"] == len(GOOD) + len(BAD) and first["clip_frac"] == 0.0
    # on-policy ratio 1: pg = -token mean of A, with A = +-0.5 / std(1, 0) = +-sqrt(0.5)
    assert first["pg_loss"] == pytest.approx(-(len(GOOD) - len(BAD)) * math.sqrt(0.5) / 7, rel=1e-4)
    for _ in range(3):
        backend.train(samples)
    trained = _load_exported(backend, tiny_model)
    assert sum(_hf_logprobs(trained, GOOD)) > sum(_hf_logprobs(start, GOOD)) + 0.05
    assert sum(_hf_logprobs(trained, BAD)) < sum(_hf_logprobs(start, BAD)) - 0.05


@pytest.mark.slow
def test_gspo_kl_in_reward_checkpoints_and_offload(tiny_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    loss = {"advantage": "gspo", "aggregation": "sequence", "kl_coef": 0.1, "kl_in_reward": True}
    backend = _backend(
        tiny_model, tmp_path / "run", mini_batches_per_step=2, checkpoint={"keep_last": 1}, loss=loss
    )
    metrics = backend.train(_group(start))
    # KL in the reward: no KL loss; the second mini-batch runs after the first update, so KL > 0
    assert metrics["kl_loss"] == 0.0 and metrics["kl"] > 0
    assert all(math.isfinite(v) for v in metrics.values())
    backend.save(1, extra={"pos": 1})
    backend.save(2, extra={"pos": 2})
    assert complete_steps(tmp_path / "run") == [2]
    assert backend.load() == {"pos": 2} and backend.step == 2

    backend.offload()
    with pytest.raises(RuntimeError, match="onload"):
        backend.train(_group(start))
    with pytest.raises(RuntimeError, match="twice"):
        backend.offload()
    backend.onload()
    with pytest.raises(RuntimeError, match="without a preceding offload"):
        backend.onload()

    with pytest.raises(ValueError, match="loss_mask"):
        backend.train([Sample(0, 0, PROMPT, GOOD, [1], [0.0] * len(GOOD))])
    with pytest.raises(ValueError, match="at least one sample"):
        backend.train([])
    with pytest.raises(FileNotFoundError, match="complete steps: 2"):
        backend.load(7)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights(tiny_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    plan = resolve(
        {
            "model": {"path": tiny_model, "dtype": "bfloat16"},
            "run": {"runs_root": str(tmp_path), "name": "bf16"},
            "train": {"device": "cpu", "loss": {"old_logprobs": "recompute"}},
        }
    )
    backend = get_backend("fsdp")()
    backend.setup(plan)
    metrics = backend.train(_group(start))
    # bf16 forward against fp32 rollout log-probs: a small, non-zero mismatch
    assert 0 < metrics["logprob_mismatch"] < 0.05
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())
    assert {t.dtype for bucket in backend.export_weights(1 << 20) for _, t in bucket} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_an_episode_counts_once_however_many_trajectories_it_produced(
    tiny_model, tmp_path, aggregation
) -> None:
    """One task with two episodes: A (one trajectory) and B. B coming back as five identical trajectories
    of weight 1/5 gives the same loss, gradient norm and update as B as one trajectory."""
    import copy

    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    good, bad = _group(start)
    split = [copy.deepcopy(bad) for _ in range(5)]
    for s in split:
        s.weight = 0.2
    runs = []
    for name, batch in (("one", [good, bad]), ("five", [good, *split])):
        backend = _backend(tiny_model, tmp_path / name, lr=1e-2, loss={"aggregation": aggregation})
        metrics = backend.train(batch)
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in backend.model.named_parameters()}  # fmt: skip
        runs.append((metrics, grads))
    (m1, g1), (m5, g5) = runs
    # the loss of a first, on-policy step is sum(advantage) ~ 0: compared at the scale of float32 noise
    assert m1["loss"] == pytest.approx(m5["loss"], rel=1e-5, abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m5["grad_norm"], rel=1e-5) and m1["grad_norm"] > 0
    worst = max(float((g1[k] - g5[k]).norm() / (g1[k].norm() + 1e-6 * m1["grad_norm"])) for k in g1)
    assert worst < 1e-4
