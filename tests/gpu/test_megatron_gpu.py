"""Megatron backend on a CUDA GPU: conversion, logits vs HF, training vs an HF reference, weights export,
offload/onload and checkpoints. Skipped without CUDA or without megatron-core.

The reference for training is the same objective (miles/train/objective.py) computed on the HF model
with torch's AdamW, in fp32 (TF32 off), so any error in layouts, shards, loss scaling or masking
shows up as a mismatch.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core forward is CUDA-only)"
    ),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


def _plan(model_path: str, runs_root: str, dtype: str, **train):
    from miles.config import Plan

    t = {"backend": "megatron", "lr": 1e-3, "grad_clip": 1.0, "max_tokens_per_microbatch": 64} | train
    return Plan.model_validate(
        {
            "model": {"path": model_path, "dtype": dtype},
            "train": t,
            "run": {"runs_root": runs_root, "name": dtype},
        }
    )


def _samples(hf, n: int = 8, seed: int = 0):
    from miles.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(4, 380) for _ in range(rng.randint(3, 9))]
        r = [rng.randrange(4, 380) for _ in range(rng.randint(2, 12))]
        mask = [1] * len(r)
        mask[0] = 0 if i % 3 == 0 else 1
        out.append(Sample(i // 4, i % 4, p, r, mask, [0.0] * len(r), reward=rng.random()))
    for s, lp in zip(out, _hf_logprobs(hf, out), strict=True):
        s.rollout_logprobs = lp.tolist()
    return out


def _hf_logprobs(hf, samples):
    dev = next(hf.parameters()).device
    res = []
    for s in samples:
        ids = torch.tensor([s.tokens], device=dev)
        logits = hf(ids).logits[0].float()
        p = len(s.prompt_ids)
        lp = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None]).squeeze(-1)
        res.append(lp)
    return res


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = tmp_path_factory.mktemp("meg")
    path = str(init_tiny(root / "tiny", arch="qwen2", seed=1, hidden_size=128, intermediate_size=256))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    return path, str(root / "runs"), hf


def _backend(env, dtype="float32", **train):
    from miles.train.megatron.backend import MegatronBackend

    b = MegatronBackend()
    b.setup(_plan(env[0], env[1], dtype, **train))
    return b


def _export(b, bucket_bytes=1 << 16):
    buckets = list(b.export_weights(bucket_bytes))
    for bk in buckets:
        assert len(bk) == 1 or sum(t.numel() * t.element_size() for _, t in bk) <= bucket_bytes
    return {k: v.detach().float().cpu().clone() for bk in buckets for k, v in bk}


def test_export_reproduces_hf_weights(env):
    b = _backend(env)
    hf_state = {k: v.cpu() for k, v in env[2].state_dict().items()}
    out = _export(b)
    assert out.keys() == hf_state.keys()
    assert all(torch.equal(out[k], hf_state[k]) for k in hf_state)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_logits_match_hf(env, dtype, tol):
    b = _backend(env, dtype)
    ids = torch.randint(4, 380, (2, 33), device="cuda")
    pos = torch.arange(33, device="cuda").expand(2, 33)
    with torch.no_grad():
        ours = b.model.module(ids, pos, None).float()
        ref = env[2](ids).logits.float()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"logits rel err {dtype}: {err:.2e}")
    assert err < tol


def _reference_step(env, samples, lr, old_logp=None, lora=None, adapter=None):
    """Loss, grad norm and updated weights of one AdamW step of the HF model on the same objective.
    With `lora` (train.lora's dict) and `adapter` (the trainer's exported adapter, PEFT's saved names
    behind `policy/`), the HF model holds that adapter through PEFT, only the adapter trains, and the
    updated weights are the adapter's, named as the trainer exports them."""
    from transformers import AutoModelForCausalLM

    from miles.config.train import LossConfig
    from miles.train.losses import get_estimator, token_weights
    from miles.train.objective import TokenBatch, policy_objective

    hf = AutoModelForCausalLM.from_pretrained(env[0], dtype=torch.float32).cuda()
    if lora is not None:
        from peft import get_peft_model, set_peft_model_state_dict

        from miles.config.train import LoraConfig
        from miles.lora.adapters import peft_config

        hf = get_peft_model(hf, peft_config(LoraConfig(**lora)))
        set_peft_model_state_dict(hf, {k.removeprefix("policy/"): v.cuda() for k, v in adapter.items()})
    cfg = LossConfig()
    adv = get_estimator("grpo").compute(
        torch.tensor([s.reward for s in samples]),
        torch.tensor([s.group_id for s in samples]),
        torch.tensor([float(sum(s.loss_mask)) for s in samples]),
        cfg,
    )
    logp = torch.cat(_hf_logprobs(hf, samples))
    mask = torch.tensor([m for s in samples for m in s.loss_mask], device="cuda", dtype=torch.float32)
    seq = torch.tensor([i for i, s in enumerate(samples) for _ in s.response_ids], device="cuda")
    a = torch.tensor([float(adv[i]) for i, s in enumerate(samples) for _ in s.response_ids], device="cuda")
    roll = torch.tensor([x for s in samples for x in s.rollout_logprobs], device="cuda")
    n_tok, n_seq = int(mask.sum()), sum(1 for s in samples if sum(s.loss_mask))
    w = token_weights(mask, seq, len(samples), "token", n_tok, n_seq)
    old = roll if old_logp is None else old_logp
    loss, _ = policy_objective(TokenBatch(logp, old, roll, a, mask, w, seq, len(samples)), cfg)
    loss.backward()
    params = [p for p in hf.parameters() if p.requires_grad]
    gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    opt.step()
    if lora is not None:
        return (
            loss.item(),
            gn.item(),
            {
                "policy/" + k.replace(".default", ""): p.detach().cpu()
                for k, p in hf.named_parameters()
                if p.requires_grad
            },
        )
    return loss.item(), gn.item(), {k: v.detach().cpu() for k, v in hf.state_dict().items()}


def test_train_step_matches_hf_reference(env):
    samples = _samples(env[2])
    b = _backend(env)
    before = _export(b)
    metrics = b.train(samples)
    after = _export(b)
    loss, gn, ref_after = _reference_step(env, samples, 1e-3)
    print("megatron", metrics, "reference loss", loss, "grad_norm", gn)
    assert abs(metrics["loss"] - loss) < 1e-4 * max(1.0, abs(loss))
    assert abs(metrics["grad_norm"] - gn) < 1e-3 * gn
    assert metrics["logprob_mismatch"] < 1e-4
    d_ours = torch.cat([(after[k] - before[k]).flatten() for k in before])
    d_ref = torch.cat([(ref_after[k] - before[k]).flatten() for k in before])
    rel = ((d_ours - d_ref).norm() / d_ref.norm()).item()
    print(f"update rel diff {rel:.2e}")
    assert d_ref.norm() > 0 and rel < 1e-2


def test_recompute_old_logprobs_gives_unit_ratio(env):
    samples = _samples(env[2], seed=3)
    for s in samples:  # wrong rollout log-probs: recompute must not use them for the ratio
        s.rollout_logprobs = [x - 0.5 for x in s.rollout_logprobs]
    b = _backend(env, loss={"old_logprobs": "recompute"})
    m = b.train(samples)
    assert m["clip_frac"] == 0.0
    assert abs(m["logprob_mismatch"] - 0.5) < 1e-3


def test_offload_onload_and_checkpoint(env):
    b = _backend(env, "bfloat16")
    samples = _samples(env[2], seed=5)
    b.train(samples)
    snap = _export(b)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    b.offload()
    freed = used - torch.cuda.memory_allocated()
    b.onload()
    assert freed >= 0.9 * b.offloader.nbytes > 0
    assert all(torch.equal(v, snap[k]) for k, v in _export(b).items())
    path = b.save(1, {"data_pos": 7})
    b.train(samples)
    assert any(not torch.equal(v, snap[k]) for k, v in _export(b).items())
    assert b.load(None) == {"data_pos": 7} and path.endswith("step_1")
    assert all(torch.equal(v, snap[k]) for k, v in _export(b).items())
    m1 = b.train(samples)
    assert m1["loss"] == m1["loss"] and b.step_count == 2


@pytest.mark.gpu2
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)])
def test_parallel_layouts_match_reference(env, tp, pp):
    """TP=2, PP=2 and DP=2 (tp=pp=1 on 2 ranks) each reproduce the single-model reference step."""
    assert "RESULT" in run_ranks(env[0], env[1] + f"/tp{tp}pp{pp}", str(tp), str(pp))


def run_ranks(*args: str) -> str:
    """The stdout of megatron_ranks.py on two GPUs under torchrun with `args`; fails the test when a
    rank fails."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("megatron_ranks.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True)
    print(proc.stdout[-2000:], proc.stderr[-4000:] if proc.returncode else "")
    assert proc.returncode == 0
    return proc.stdout


def test_ppo_critic_warmup_and_checkpoint(env):
    """PPO's critic on Megatron: warm-up steps leave the policy bit-identical and train the critic;
    a checkpoint restores the critic (its next step equals the original's)."""
    samples = _samples(env[2], seed=7)
    b = _backend(env, "bfloat16", loss={"advantage": "ppo"}, critic={"lr": 1e-3, "warmup_steps": 1})
    policy = _export(b)
    head = b.critic.gpt.value_head.weight.detach().clone()
    m = b.train(samples)
    assert m["critic/warmup"] == 1.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(v, policy[k]) for k, v in _export(b).items())
    assert not torch.equal(head, b.critic.gpt.value_head.weight)
    m = b.train(samples)
    assert (
        m["critic/warmup"] == 0.0
        and m["grad_norm"] > 0
        and {"critic/clipfrac", "critic/explained_variance"} <= set(m)
    )
    b.save(2, {"pos": 2})
    after_save = b.train(samples)
    b.load(2)
    again = b.train(samples)
    assert again["critic/value_loss"] == pytest.approx(after_save["critic/value_loss"], rel=1e-3)
    assert b.critic.steps == 3
