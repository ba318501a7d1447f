"""HF <-> Megatron mapping on CPU: fused layouts, TP shards, the full round trip, and the CPU error.

The mapping is pure tensor code and runs without megatron-core; the GPTModel build test needs it
and is skipped when it is absent (it is a dev dependency, so CI runs it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miles.config import ConfigError, Plan
from miles.train.megatron import convert

S = convert.Shapes(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=3, hidden=12, vocab=16, tied=False)


def _hf_state(s: convert.Shapes, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, ffn = s.hidden, s.head_dim, 20

    def r(*shape):
        return torch.randn(*shape, generator=g)

    out = {
        "model.embed_tokens.weight": r(s.vocab, h),
        "model.norm.weight": r(h),
        "lm_head.weight": r(s.vocab, h),
    }
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": r(h),
            p + "post_attention_layernorm.weight": r(h),
            p + "self_attn.q_proj.weight": r(s.num_heads * d, h),
            p + "self_attn.q_proj.bias": r(s.num_heads * d),
            p + "self_attn.k_proj.weight": r(s.num_kv_heads * d, h),
            p + "self_attn.k_proj.bias": r(s.num_kv_heads * d),
            p + "self_attn.v_proj.weight": r(s.num_kv_heads * d, h),
            p + "self_attn.v_proj.bias": r(s.num_kv_heads * d),
            p + "self_attn.o_proj.weight": r(h, s.num_heads * d),
            p + "mlp.gate_proj.weight": r(ffn, h),
            p + "mlp.up_proj.weight": r(ffn, h),
            p + "mlp.down_proj.weight": r(h, ffn),
        }
    return out


def test_round_trip_is_identity():
    hf = _hf_state(S)
    mg = convert.hf_to_megatron(hf, S)
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in mg
    back = convert.megatron_to_hf(mg, S)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_groups_hold_their_own_heads():
    """Group g of linear_qkv holds query heads g*H/G.. of HF and kv head g (what repeat_kv pairs)."""
    hf = _hf_state(S)
    qkv = convert.hf_to_megatron(hf, S)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, qpg = S.head_dim, S.num_heads // S.num_kv_heads
    group1 = qkv.reshape(S.num_kv_heads, (qpg + 2) * d, -1)[1]
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(group1[: qpg * d], q[qpg * d : 2 * qpg * d])
    assert torch.equal(
        group1[qpg * d : (qpg + 1) * d], hf["model.layers.0.self_attn.k_proj.weight"][d : 2 * d]
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_shards_reassemble(tp):
    mg = convert.hf_to_megatron(_hf_state(S), S)
    for name, full in mg.items():
        shards = [convert.tp_shard(name, full, r, tp, S) for r in range(tp)]
        assert torch.equal(convert.tp_unshard(name, shards, S), full), name
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    rank1 = convert.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2, S)
    assert torch.equal(rank1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


def test_tied_and_te_names():
    tied = convert.Shapes(2, 4, 2, 3, 12, 16, tied=True, te_names=True)
    hf = {k: v for k, v in _hf_state(tied).items() if k != "lm_head.weight"}
    mg = convert.hf_to_megatron(hf, tied)
    assert "output_layer.weight" not in mg
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mg
    assert convert.megatron_to_hf(mg, tied).keys() == hf.keys()
    with pytest.raises(KeyError, match="unmapped"):
        convert.megatron_to_hf({"decoder.layers.0.mystery.weight": torch.zeros(1)}, S)


def test_setup_without_cuda_names_the_key():
    from miles.train.megatron.backend import MegatronBackend

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error is for CPU-only machines")
    plan = Plan.model_validate({"train": {"backend": "megatron"}})
    with pytest.raises(ConfigError, match="train.backend"):
        MegatronBackend().setup(plan)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_gptmodel_on_cpu_loads_and_returns_hf_weights(tiny_model):
    """Build the real GPTModel (local spec) on CPU, load the HF weights, read them back unchanged."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from miles.train.megatron import model as M

    ours = not dist.is_initialized()
    if ours:  # a private world-size-1 group, torn down below so later tests start clean
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
    try:
        cfg = AutoConfig.from_pretrained(tiny_model)
        gpt = M.build_gpt(cfg, M.transformer_config(cfg, torch.float32, 1, 1, use_cpu=True))
        hf = M.read_hf_state(tiny_model)
        M.load_hf_into(gpt, hf, cfg)
        back = convert.megatron_to_hf(gpt.state_dict(), M.shapes_of(cfg))
    finally:
        if ours:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
