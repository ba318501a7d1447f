"""True on-policy on the GPU in bf16: a CUDA engine started with `--enable-deterministic-inference
--rl-on-policy-target fsdp` samples requests of different lengths together (mixed batches, parallel
samples, cached prefixes, CUDA-graph decode buckets for the dense models), and the trainer's bf16
forward under train.true_on_policy gives every sampled token the same log-prob bit for bit; the tiny
Qwen2 / Qwen3 models, a random model of Qwen2.5-0.5B's shapes, and the tiny Qwen3-MoE with routing
replay (the trainer's routers follow the experts the engine returned). Without the mode the
log-probs differ."""

from __future__ import annotations

import pytest
import torch
from on_policy import FLAGS, chunked_prefill_logits, rollout, trainer_logprobs

from miles.engine.process import start_engine

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "qwen2-0.5b", "qwen3_moe"])
def model(request, tmp_path_factory) -> str:
    from miles.models.tiny import init_random, init_tiny

    out = tmp_path_factory.mktemp("models") / request.param
    if request.param == "qwen2-0.5b":  # Qwen2.5-0.5B's shapes, random weights, the tiny tokenizer's ids
        return str(init_random(out, dtype="bfloat16", seed=0))
    return str(init_tiny(out, arch=request.param, seed=0))


@pytest.fixture(scope="module")
def rollouts(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("true-on-policy-gpu")
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192)
    routed = _moe(model)
    extra = ["--enable-return-routed-experts"] if routed else []
    on = start_engine(model, log_path=logs / "on.log", extra_args=FLAGS + extra, **kw)
    try:
        got_on = rollout(on.url, routed=routed)
    finally:
        on.stop()
    off = start_engine(model, log_path=logs / "off.log", extra_args=extra, **kw)
    try:
        got_off = rollout(off.url, routed=routed)
    finally:
        off.stop()
    return got_on, got_off


def _moe(model: str) -> bool:
    return model.endswith("qwen3_moe")


def test_bf16_trainer_log_probs_equal_the_engine_bit_for_bit(model, rollouts) -> None:
    samples, _ = rollouts
    trainer = trainer_logprobs(model, samples, True, device="cuda", dtype=torch.bfloat16, replay=_moe(model))
    for s, got in zip(samples, trainer, strict=True):
        engine = torch.tensor(s["logprobs"], dtype=torch.float32)
        assert torch.equal(got, engine), (s["prompt"][:5], (got - engine).abs().max())


def test_bf16_without_the_mode_differs(model, rollouts) -> None:
    _, samples = rollouts
    trainer = trainer_logprobs(model, samples, False, device="cuda", dtype=torch.bfloat16, replay=_moe(model))
    diffs = [
        (got - torch.tensor(s["logprobs"])).abs().max().item()
        for s, got in zip(samples, trainer, strict=True)
    ]
    print(f"true on-policy off, bf16 max |delta logp| per sample: {[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) > 0.0


def test_bf16_chunked_prefill_gives_the_same_bits_as_one_prefill(model) -> None:
    whole, chunked = chunked_prefill_logits(model, "cuda", torch.bfloat16, invariant=True)
    assert torch.equal(whole, chunked), (whole - chunked).abs().max()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_bf16_triton_kernels_bit_for_bit(arch, tmp_path, monkeypatch) -> None:
    """MILES_INVARIANT_GPU=triton (miles/quant/invariant_triton.py) in the engine and the trainer."""
    from miles.models.tiny import init_tiny
    from miles.quant import invariant

    model = str(init_tiny(tmp_path / arch, arch=arch, seed=0))
    routed = _moe(model)
    extra = ["--enable-return-routed-experts"] if routed else []
    eng = start_engine(model, device="cuda", dtype="bfloat16", max_total_tokens=8192, log_path=tmp_path / "e.log",
                       extra_args=FLAGS + extra, env={"MILES_INVARIANT_GPU": "triton"})  # fmt: skip
    try:
        samples = rollout(eng.url, routed=routed)
    finally:
        eng.stop()
    monkeypatch.setattr(invariant, "GPU_KERNELS", "triton")
    trainer = trainer_logprobs(model, samples, True, device="cuda", dtype=torch.bfloat16, replay=routed)
    for s, got in zip(samples, trainer, strict=True):
        engine = torch.tensor(s["logprobs"], dtype=torch.float32)
        assert torch.equal(got, engine), (s["prompt"][:5], (got - engine).abs().max())
