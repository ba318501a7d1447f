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
def test_bf16_plain_torch_forms_bit_for_bit(arch, tmp_path, monkeypatch) -> None:
    """MILES_INVARIANT_GPU=torch (the plain-PyTorch forms of miles/quant/invariant.py, not the Triton
    kernels of the default) in the engine and the trainer."""
    from miles.models.tiny import init_tiny
    from miles.quant import invariant

    model = str(init_tiny(tmp_path / arch, arch=arch, seed=0))
    routed = _moe(model)
    extra = ["--enable-return-routed-experts"] if routed else []
    eng = start_engine(model, device="cuda", dtype="bfloat16", max_total_tokens=8192, log_path=tmp_path / "e.log",
                       extra_args=FLAGS + extra, env={"MILES_INVARIANT_GPU": "torch"})  # fmt: skip
    try:
        samples = rollout(eng.url, routed=routed)
    finally:
        eng.stop()
    monkeypatch.setattr(invariant, "GPU_KERNELS", "torch")
    trainer = trainer_logprobs(model, samples, True, device="cuda", dtype=torch.bfloat16, replay=routed)
    for s, got in zip(samples, trainer, strict=True):
        engine = torch.tensor(s["logprobs"], dtype=torch.float32)
        assert torch.equal(got, engine), (s["prompt"][:5], (got - engine).abs().max())


def test_the_trainers_step_reads_nothing_back_from_the_gpu(tmp_path) -> None:
    """With the Triton kernels, a packed row's invariant forward and backward call no synchronizing CUDA
    operation from Miles' code once its position ids were read (the first forward): torch's sync
    debug mode warns at each one, naming the Python line that called it."""
    import os
    import warnings

    from transformers import AutoModelForCausalLM

    import miles
    from miles.models.tiny import init_tiny
    from miles.quant import invariant
    from miles.train.fsdp import true_on_policy as top

    assert invariant.GPU_KERNELS == "triton", "the default kernels on CUDA"
    model = init_tiny(tmp_path / "m", arch="qwen2", seed=0)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda()
    top.install(net)
    lengths = [5, 40, 17]
    ids = torch.randint(3, 300, (1, sum(lengths)), device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    rows, targets = torch.arange(sum(lengths) - 1, device="cuda"), ids[0, 1:]

    def step():
        net.zero_grad(set_to_none=True)
        logits = net(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        top.logprobs(logits, rows, targets, 1.0).mean().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    print(f"synchronizing operations in the second step: {syncs}")
    package = os.path.dirname(miles.__file__) + os.sep
    assert not [s for s in syncs if s.startswith(package)], syncs
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
