"""True on-policy, engine against trainer: a real engine process started with SGLang's
`--enable-deterministic-inference --rl-on-policy-target fsdp` samples requests of different lengths
together (mixed prefill and decode batches of changing size, parallel samples, prompts continuing
cached prefixes), and the FSDP trainer's forward under train.true_on_policy (transformers' model with
miles/train/fsdp/true_on_policy.py installed, all sequences packed in one row as the trainer packs
them) gives every sampled token the same log-prob, bit for bit (`torch.equal`). Without the mode the
same comparison differs (so the test can fail)."""

from __future__ import annotations

import httpx
import pytest
import torch
from on_policy import FLAGS, chunked_prefill_logits, rollout, trainer_logprobs

from miles.engine.process import start_engine
from miles.quant import invariant as inv


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "qwen3_moe"])
def model(request, tmp_path_factory) -> str:
    """Tiny models: Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Qwen3-MoE (routed experts)."""
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / request.param, arch=request.param, seed=0))


@pytest.fixture(scope="module")
def rollouts(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("true-on-policy")
    on = start_engine(model, device="cpu", log_path=logs / "on.log", extra_args=FLAGS, max_total_tokens=4096)
    off = start_engine(model, device="cpu", log_path=logs / "off.log", max_total_tokens=4096)
    try:
        info = httpx.get(on.url + "/server_info", timeout=30).json()
        yield info, rollout(on.url), rollout(off.url)
    finally:
        on.stop()
        off.stop()


def test_the_trainer_reproduces_every_sampled_log_prob_bit_for_bit(model, rollouts) -> None:
    info, samples, _ = rollouts
    assert info["enable_deterministic_inference"] is True and info["rl_on_policy_target"] == "fsdp"
    assert len(samples) == 8 and sum(len(s["output"]) for s in samples) > 80
    trainer = trainer_logprobs(model, samples, true_on_policy=True)
    for s, got in zip(samples, trainer, strict=True):
        engine = torch.tensor(s["logprobs"], dtype=torch.float32)
        assert torch.equal(got, engine), (s["prompt"][:5], (got - engine).abs().max())


def test_without_the_mode_the_log_probs_differ(model, rollouts) -> None:
    _, _, samples = rollouts
    trainer = trainer_logprobs(model, samples, true_on_policy=False)
    diffs = [
        (got - torch.tensor(s["logprobs"])).abs().max().item()
        for s, got in zip(samples, trainer, strict=True)
    ]
    assert max(diffs) > 0.0 and max(diffs) < 1e-3  # the same policy, other bits


def test_the_invariant_forward_refuses_what_it_does_not_cover(tiny_model) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "miles.engine", "--model", tiny_model, "--device", "cpu",
                          *FLAGS, "--quantization", "fp8_block"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "--enable-deterministic-inference does not cover" in out.stderr


def test_greedy_and_sampled_log_probs_are_the_invariant_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    lp = inv.token_logprobs(logits, torch.tensor([1, 2, 3]), torch.tensor([1.0, 0.5, 2.0]))
    want = torch.stack([torch.log_softmax(logits[i] / t, -1)[i + 1] for i, t in enumerate((1.0, 0.5, 2.0))])
    torch.testing.assert_close(lp, want)


def test_moe_with_routing_replay_reproduces_every_log_prob(tmp_path) -> None:
    """Qwen3-MoE, the engine returning its routed experts and the trainer's routers replaying them."""
    from miles.models.tiny import init_tiny

    model = str(init_tiny(tmp_path / "moe", arch="qwen3_moe", seed=1))
    flags = FLAGS + ["--enable-return-routed-experts"]
    eng = start_engine(
        model, device="cpu", log_path=tmp_path / "engine.log", extra_args=flags, max_total_tokens=4096
    )
    try:
        samples = rollout(eng.url, routed=True)
    finally:
        eng.stop()
    assert all(s["routed"] for s in samples)
    for s, got in zip(samples, trainer_logprobs(model, samples, True, replay=True), strict=True):
        assert torch.equal(got, torch.tensor(s["logprobs"], dtype=torch.float32)), s["prompt"][:5]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_chunked_prefill_gives_the_same_bits_as_one_prefill(arch, tmp_path) -> None:
    from miles.models.tiny import init_tiny

    model = str(init_tiny(tmp_path / arch, arch=arch, seed=0))
    whole, chunked = chunked_prefill_logits(model, "cpu", torch.float32, invariant=True)
    assert torch.equal(whole, chunked)
    whole, chunked = chunked_prefill_logits(model, "cpu", torch.float32, invariant=False)
    assert not torch.equal(whole, chunked)  # the ordinary forward: other bits
