"""DeepSeek-V3 in the Megatron backend on CUDA (megatron-core's latent attention and DeepSeek router):
export reproduces the checkpoint, logits equal transformers' in fp32, and a training step with
routing replay routes every token through the given experts, moves the router but never its
correction bias (a frozen buffer in transformers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_backends_agree import megatron_backend  # noqa: E402
from test_fsdp_gpu import make_samples  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core is CUDA-only)"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96,
             kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
             n_group=4, topk_group=2, num_experts_per_tok=4, moe_intermediate_size=64, num_hidden_layers=4)  # fmt: skip
TRAIN = dict(grad_clip=1e6, lr=1e-4, max_tokens_per_microbatch=64)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    root = tmp_path_factory.mktemp("meg_ds")
    path = str(init_tiny(root / "v3", arch="deepseek_v3", seed=5, **SIZES))
    samples = make_samples(path, n=8, seed=6)
    rng = np.random.default_rng(7)
    E, k, L = SIZES["n_routed_experts"], SIZES["num_experts_per_tok"], SIZES["num_hidden_layers"]
    for s in samples:  # random routing, k distinct experts per token and sparse layer (layer 0 dense)
        rows = np.zeros((len(s.tokens) - 1, L, k), dtype=np.uint8)
        for t in range(rows.shape[0]):
            for layer in range(1, L):
                rows[t, layer] = rng.permutation(E)[:k]
        s.routed_experts = rows.reshape(len(s.tokens) - 1, L * k)
    return path, str(root / "runs"), samples


def _export(b) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for bk in b.export_weights(1 << 20) for k, v in bk}


def test_export_and_logits(env):
    from transformers import AutoModelForCausalLM

    from miles.train.megatron.model import read_hf_state

    b = megatron_backend(env[0], env[1], "export", "float32")
    want, got = read_hf_state(env[0]), _export(b)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].float()) for k in want)
    ids = torch.randint(4, 380, (2, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(33, device="cuda").expand(2, 33)
    with torch.no_grad():
        ref = (
            AutoModelForCausalLM.from_pretrained(env[0], dtype=torch.float32)
            .cuda()
            .eval()(ids)
            .logits.float()
        )
        ours = b.model.module(ids, pos, None).float()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"DeepSeek-V3 Megatron vs transformers logits rel err fp32: {err:.2e}")
    assert err < 1e-4


def _replay_step(env, name: str, frozen: tuple[str, ...]):
    """One float32 step with routing replay: every token through the given experts, the routers moved
    and the tensors named by `frozen` suffixes not; (backend, router names, frozen names, after)."""
    b = megatron_backend(env[0], env[1], name, "float32", routing_replay="rollout", **TRAIN)
    before = _export(b)
    m = b.train(env[2])
    after = _export(b)
    print({k: v for k, v in m.items() if not k.startswith("moe_expert_load")})
    assert m["router_agreement"] == 1.0 and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    gates = [k for k in before if k.endswith("mlp.gate.weight")]
    fixed = [k for k in before if k.endswith(frozen)]
    assert all(not torch.equal(before[k], after[k]) for k in gates)
    assert all(torch.equal(before[k], after[k]) for k in fixed)
    return b, gates, fixed, after


def test_replay_trains_the_router_but_not_its_bias(env):
    _, gates, biases, _ = _replay_step(env, "replay", ("e_score_correction_bias",))
    assert len(gates) == len(biases) == 3


# ---- DeepSeek-V4: Miles' Megatron modules in the backend (miles/train/megatron/deepseek_v4_model.py)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    root = tmp_path_factory.mktemp("meg_v4")
    path = str(init_tiny(root / "v4", arch="deepseek_v4", seed=5))
    samples = make_samples(path, n=8, seed=6)
    rng = np.random.default_rng(7)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    E, k, L = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    for s in samples:  # random routing, k distinct experts per token and layer
        rows = np.stack([rng.permutation(E)[:k] for _ in range((len(s.tokens) - 1) * L)]).astype(np.uint8)
        s.routed_experts = rows.reshape(len(s.tokens) - 1, L * k)
    return path, str(root / "runs"), samples


def test_v4_export_and_logits(v4):
    from transformers import AutoModelForCausalLM

    from miles.models.families.deepseek_v4 import hf_names
    from miles.train.megatron.model import read_hf_state

    b = megatron_backend(v4[0], v4[1], "v4-export", "float32")
    assert b.arch.name == "deepseek_v4" and not b.packed
    want, got = hf_names(read_hf_state(v4[0])), _export(b)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].float()) for k in want)
    ids = torch.randint(4, 380, (2, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(v4[0], dtype=torch.float32).cuda().eval()
        ref = hf(ids).logits.float()
        ours = b.model.module(ids).float()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"DeepSeek-V4 Megatron vs transformers logits rel err fp32: {err:.2e}")
    assert err < 1e-4


def test_v4_replay_step_trains_routers_not_tables(v4):
    b, gates, frozen, after = _replay_step(v4, "v4-replay", ("e_score_correction_bias", "gate.tid2eid"))
    assert gates and frozen
    b.save(1, {"mark": 1})  # megatron-core's distributed checkpoint of the V4 modules, and back
    b.train(v4[2])
    assert b.load(1) == {"mark": 1}
    back = _export(b)
    assert all(torch.equal(back[k], after[k]) for k in after)
