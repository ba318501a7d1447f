"""FSDP2 backend on a CUDA GPU (NCCL, one rank in this process): bf16 training, offload/onload of
device memory (measured in a fresh process), and the CPU-offloaded optimiser against torch's AdamW.
Skipped without CUDA.

The batch's rollout log-probs are the fp32 HF model's own, so the PPO ratio starts at 1 and the
objective is the GRPO surrogate of miles/train/objective.py; repeating one fixed batch must lower it.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FSDP2 over NCCL)"),
]


def make_samples(model_path: str, n: int = 8, seed: int = 0) -> list:
    """`n` samples in groups of 4 with random tokens, rewards, and the fp32 HF model's log-probs."""
    from transformers import AutoModelForCausalLM

    from miles.sample import Sample

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 380) for _ in range(rng.randint(3, 9))]
        resp = [rng.randrange(4, 380) for _ in range(rng.randint(2, 12))]
        mask = [1] * len(resp)
        mask[0] = 0 if i % 3 == 0 else 1
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + resp], device="cuda")).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        lp = logp.gather(-1, torch.tensor(resp, device="cuda")[:, None]).squeeze(-1)
        out.append(Sample(i // 4, i % 4, prompt, resp, mask, lp.tolist(), reward=rng.random()))
    return out


def fsdp_backend(model_path: str, runs_root: str, name: str, dtype: str = "bfloat16", **train):
    """A set-up FSDP backend on CUDA for the given model and train overrides."""
    from miles.config import resolve
    from miles.train import get_backend

    t = {"device": "cuda", "lr": 1e-3, "max_tokens_per_microbatch": 64} | train
    plan = resolve(
        {
            "model": {"path": model_path, "dtype": dtype},
            "run": {"runs_root": runs_root, "name": name},
            "train": t,
        }
    )
    b = get_backend("fsdp")()
    b.setup(plan)
    return b


def full_weights(b) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for bk in b.export_weights(1 << 20) for k, v in bk}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = tmp_path_factory.mktemp("fsdp_gpu")
    path = str(init_tiny(root / "tiny", arch="qwen2", seed=1, hidden_size=128, intermediate_size=256))
    return path, str(root / "runs"), make_samples(path)


def test_bf16_training_lowers_the_loss_on_a_fixed_batch(env):
    # a small LR: with 1e-3 one Adam step already pushes every ratio to the clip and the loss stalls
    b = fsdp_backend(env[0], env[1], "bf16", lr=2e-5)
    assert b.device.type == "cuda"
    masters = [p for p in b.model.parameters()]
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in masters)
    before = full_weights(b)
    losses = []
    for _ in range(5):
        m = b.train(env[2])
        assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "entropy", "logprob_mismatch"))
        losses.append(m["loss"])
    print("fsdp bf16 losses", losses)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < losses[0] - 1e-2
    after = full_weights(b)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_offload_frees_and_onload_restores_device_memory(env):
    """Measured in a fresh process (tests/gpu/memory_probes.py): in this one, earlier tests' objects
    collected between offload and onload would shrink the allocated bytes the test compares."""
    from memory_probes import run_probe

    r = run_probe("fsdp", env[0], env[1])
    # at least the fp32 master weights and Adam's two moments (gradients come on top)
    expected = 3 * 4 * r["n_params"]
    assert r["allocated"] - r["offloaded_allocated"] >= 0.9 * expected, r
    assert r["params_on_cpu_after_offload"]
    assert "onload" in r["train_while_offloaded_error"], r["train_while_offloaded_error"]
    assert r["onloaded_allocated"] >= r["allocated"] - 0.1 * expected, r
    assert r["params_on_cuda_after_onload"] and r["optimizer_state_on_cuda"]
    assert r["weights_equal_after_onload"]
    assert math.isfinite(r["loss_after_onload"]) and r["step_after_onload"] == 2


def test_cpu_offloaded_optimizer_equals_torch_adamw_fp32(env):
    """Same bits as AdamW(foreach=False); the math SDPA kernel keeps both backward passes deterministic."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from miles.train.offload import OffloadedAdamW
    from miles.train.optim import build_scheduler

    common = dict(weight_decay=0.1, grad_clip=1.0, lr_decay="linear", steps=4)
    ref = fsdp_backend(env[0], env[1], "ref", "float32", **common)
    t = ref.plan.train
    ref.optimizer = torch.optim.AdamW(
        ref.model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, foreach=False
    )
    ref.scheduler = build_scheduler(ref.optimizer, t)
    off = fsdp_backend(
        env[0], env[1], "off", "float32", optimizer_offload="cpu", offload_bucket_mb=1, **common
    )
    assert isinstance(off.optimizer, OffloadedAdamW) and len(off.optimizer.buckets) >= 2
    start = full_weights(ref)
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(3):
            m_ref, m_off = ref.train(env[2]), off.train(env[2])
            assert m_ref["loss"] == m_off["loss"] and m_ref["grad_norm"] == m_off["grad_norm"]
    a, b = full_weights(ref), full_weights(off)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |w_ref - w_offload| = {diff:.3e}")
    assert any(not torch.equal(a[k], start[k]) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    images = off.optimizer.store.images
    assert images and all(img.device.type == "cpu" and img.is_pinned() for img in images)
