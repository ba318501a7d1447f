"""FSDP2 and Megatron-core compute the same training step: loss, grad norm, and every parameter's
gradient mapped to its Hugging Face name, on one small Qwen2-shaped model and batch (one CUDA GPU).

Gradients are read after `train()` (clipping is disabled by a huge `grad_clip`, so they are the raw
dL/dtheta): FSDP's fp32 `param.grad` (DTensor, full on one rank) and Megatron's fp32 `main_grad`
buffers, the latter through the checkpoint converter (fused QKV and gate/up split back into HF
tensors). Per tensor the error is ||g_fsdp - g_megatron|| / (||g_megatron|| + 1e-3 G), G the global
grad norm; the floor keeps tensors whose gradient is zero in exact arithmetic (the key bias: softmax
ignores a per-query constant) from turning rounding noise into a large relative error.

Tolerances. fp32 with TF32 off: the two backends differ only in summation order (fused vs separate
GEMMs, micro-batch packing), so errors sit near 1e-6 (H200, 2026-11-30: 4.8e-7 on the whole gradient);
we allow 1e-5 on the loss, 1e-4 on the grad norm, 1e-3 per tensor. bf16: both run the forward and
backward in bf16 (unit roundoff u = 2^-9 ~ 2e-3) and round at different places (Megatron's fused QKV
and gate/up GEMMs, its RoPE and norm kernels), so gradients differ by a few u relative (measured:
4.5e-3 on the whole gradient, 6.4e-3 on the worst tensor, 1.4e-4 on the grad norm); we allow 5e-3
absolute on the loss (advantages are O(1)), 1e-2 on the grad norm, 2e-2 on the whole gradient and
3e-2 per tensor (10-15 u, 4-5x the measured error). A mis-mapped tensor (q/k or gate/up swapped,
a transposed shard) gives errors of order 1.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from test_fsdp_gpu import fsdp_backend, make_samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core is CUDA-only)"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

TOL = {
    "float32": dict(loss=1e-5, grad_norm=1e-4, total=1e-4, tensor=1e-3),
    "bfloat16": dict(loss=5e-3, grad_norm=1e-2, total=2e-2, tensor=3e-2),
}
TRAIN = dict(grad_clip=1e6, lr=1e-4, max_tokens_per_microbatch=64)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = tmp_path_factory.mktemp("agree")
    path = str(init_tiny(root / "tiny", arch="qwen2", seed=2, hidden_size=128, intermediate_size=256))
    return path, str(root / "runs"), make_samples(path, n=12, seed=4)


def megatron_backend(model_path: str, runs_root: str, name: str, dtype: str, **train):
    from miles.config import resolve
    from miles.train import get_backend

    plan = resolve(
        {
            "model": {"path": model_path, "dtype": dtype},
            "run": {"runs_root": runs_root, "name": name},
            "train": {"backend": "megatron", "device": "cuda"} | train,
        }
    )
    b = get_backend("megatron")()
    b.setup(plan)
    return b


def fsdp_grads(b) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in b.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().float().cpu()
    return out


def megatron_grads(b) -> dict[str, torch.Tensor]:
    from miles.train.megatron import convert
    from miles.train.megatron import model as M

    items = ((convert.to_global(n, 0), p.main_grad) for n, p in b.gpt.named_parameters())
    s = M.shapes_of(b.hf_cfg)
    return {k: v.detach().float().cpu().clone() for k, v in convert.iter_megatron_to_hf(items, s)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_and_megatron_agree(env, dtype):
    tol = TOL[dtype]
    fs = fsdp_backend(env[0], env[1], f"fsdp_{dtype}", dtype, **TRAIN)
    m_f = fs.train(env[2])
    g_f = fsdp_grads(fs)
    mg = megatron_backend(env[0], env[1], f"meg_{dtype}", dtype, **TRAIN)
    m_m = mg.train(env[2])
    g_m = megatron_grads(mg)
    assert g_f.keys() == g_m.keys()
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in g_m.values()))
    errs = {k: float((g_f[k] - g_m[k]).norm() / (g_m[k].norm() + 1e-3 * total)) for k in g_m}
    flat_f = torch.cat([g_f[k].flatten() for k in g_m])
    flat_m = torch.cat([g_m[k].flatten() for k in g_m])
    whole = float((flat_f - flat_m).norm() / flat_m.norm())
    worst = max(errs, key=errs.get)
    print(
        f"{dtype}: loss fsdp {m_f['loss']:.6f} megatron {m_m['loss']:.6f}; grad_norm fsdp "
        f"{m_f['grad_norm']:.6f} megatron {m_m['grad_norm']:.6f} (from grads {total:.6f}); whole-grad rel "
        f"{whole:.2e}; worst tensor {worst} {errs[worst]:.2e}; mismatch fsdp {m_f['logprob_mismatch']:.2e} "
        f"megatron {m_m['logprob_mismatch']:.2e}"
    )
    assert total > 0 and m_f["tokens"] == m_m["tokens"]
    assert abs(m_f["loss"] - m_m["loss"]) <= tol["loss"] * max(1.0, abs(m_m["loss"]))
    assert abs(m_f["grad_norm"] - m_m["grad_norm"]) <= tol["grad_norm"] * m_m["grad_norm"]
    assert abs(m_m["grad_norm"] - total) <= 1e-3 * total  # the reported norm is these gradients' norm
    assert whole <= tol["total"]
    assert errs[worst] <= tol["tensor"], sorted(errs.items(), key=lambda kv: -kv[1])[:5]


def test_ppo_critics_agree(env):
    """PPO in fp32: the same GAE advantages give the same policy loss, and after one critic update
    (zero-initialised heads, Adam at the same LR) the same value loss on the next step."""
    ppo = dict(TRAIN, grad_clip=1.0, loss={"advantage": "ppo"}, critic={"lr": 1e-3})
    fs = fsdp_backend(env[0], env[1], "fsdp_ppo", "float32", **ppo)
    mg = megatron_backend(env[0], env[1], "meg_ppo", "float32", **ppo)
    f1, m1 = fs.train(env[2]), mg.train(env[2])
    f2, m2 = fs.train(env[2]), mg.train(env[2])
    print({k: (f1[k], m1[k], f2[k], m2[k]) for k in f1 if k.startswith("critic/") or k == "loss"})
    assert abs(f1["loss"] - m1["loss"]) <= 1e-5 * max(1.0, abs(m1["loss"]))
    assert f1["critic/value_loss"] == pytest.approx(m1["critic/value_loss"], rel=1e-5)
    assert f1["critic/returns_mean"] == pytest.approx(m1["critic/returns_mean"], rel=1e-5)
    assert m2["critic/value_loss"] < m1["critic/value_loss"]
    assert f2["critic/value_loss"] == pytest.approx(m2["critic/value_loss"], rel=1e-3)
    assert f2["critic/explained_variance"] == pytest.approx(m2["critic/explained_variance"], abs=1e-3)


def _with_teacher_topk(samples, k: int = 5, seed: int = 0):
    """Copies of `samples` carrying a made-up teacher top-k per response token (mass 0.9 on k ids)."""
    import copy

    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for s in samples:
        c = copy.deepcopy(s)
        n = c.response_length
        ids = np.stack([rng.choice(np.arange(4, 380), size=k, replace=False) for _ in range(n)]).astype(
            np.int64
        )
        probs = rng.dirichlet(np.ones(k), size=n) * 0.9
        c.teacher_topk = (ids, np.log(probs).astype(np.float32))
        out.append(c)
    return out


def test_topk_distillation_agrees(env):
    """train.distill mode topk_reverse_kl in fp32: the same KL term (loss, metric, grad norm) in both."""
    distill = {"teacher_urls": ["http://127.0.0.1:9"], "mode": "topk_reverse_kl", "coef": 0.5}
    train = dict(TRAIN, distill=distill)
    samples = _with_teacher_topk(env[2])
    fs = fsdp_backend(env[0], env[1], "fsdp_topk", "float32", **train)
    mg = megatron_backend(env[0], env[1], "meg_topk", "float32", **train)
    f, m = fs.train(samples), mg.train(samples)
    print({k: (f[k], m[k]) for k in ("loss", "distill_reverse_kl", "grad_norm")})
    assert f["distill_reverse_kl"] > 0.1
    assert f["distill_reverse_kl"] == pytest.approx(m["distill_reverse_kl"], rel=1e-5)
    assert f["loss"] == pytest.approx(m["loss"], rel=1e-5, abs=1e-6)
    assert f["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-4)


def test_trajectory_weights_agree(env):
    """Samples of episodes that came back as several trajectories (Sample.weight < 1), fp32, sequence
    aggregation: both backends give the same loss and grad norm, and the same as the unsplit batch."""
    import copy

    split = []
    for s in env[2]:
        if s.index % 2:  # every other episode as two trajectories of weight 1/2
            for _ in range(2):
                c = copy.deepcopy(s)
                c.weight = 0.5
                split.append(c)
        else:
            split.append(s)
    train = dict(TRAIN, loss={"aggregation": "sequence"})
    fs = fsdp_backend(env[0], env[1], "fsdp_w", "float32", **train)
    mg = megatron_backend(env[0], env[1], "meg_w", "float32", **train)
    plain = megatron_backend(env[0], env[1], "meg_plain", "float32", **train)
    f, m, p = fs.train(split), mg.train(split), plain.train(env[2])
    print({k: (f[k], m[k], p[k]) for k in ("loss", "grad_norm")})
    assert f["loss"] == pytest.approx(m["loss"], rel=1e-5, abs=1e-7)
    assert f["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-4)
    assert m["loss"] == pytest.approx(p["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-4)
