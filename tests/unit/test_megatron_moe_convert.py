"""Qwen3-MoE in the Megatron backend, the parts that run without megatron-core: HF <-> Megatron expert
weights (round trip on a tiny random checkpoint written by transformers, expert-parallel and
tensor-parallel splits), the TransformerConfig fields, the routing rows in the router's token order,
and the layout rules (uneven pipeline stages, MoE with tensor parallelism)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.config import ConfigError, resolve
from miles.config.layout import stage_layers
from miles.sample import Sample
from miles.train.megatron import convert, moe
from miles.train.routing_replay import MoEShape

SIZES = dict(hidden_size=64, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random Qwen3-MoE (layer 0 dense) and its safetensors state (per-expert HF names)."""
    from safetensors.torch import load_file

    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", seed=3, **SIZES)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state |= load_file(str(f))
    return path, state


def _cfg(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_shapes_know_the_sparse_layers(tiny):
    s = convert.Shapes.from_hf(_cfg(tiny[0]))
    assert s.moe_layers == (1, 2) and s.num_experts == 4
    cfg = types.SimpleNamespace(
        num_hidden_layers=6, num_experts=8, mlp_only_layers=[3], decoder_sparse_step=2
    )
    assert convert.sparse_layers(cfg) == [1, 5]  # (i + 1) % 2 == 0, minus the dense layer 3
    assert convert.sparse_layers(types.SimpleNamespace(num_hidden_layers=2)) == []


def test_round_trip_is_identity(tiny):
    _, hf = tiny
    s = convert.Shapes.from_hf(_cfg(tiny[0]))
    mg = convert.hf_to_megatron(hf, s)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mg and "decoder.layers.0.mlp.router.weight" not in mg
    assert mg["decoder.layers.1.mlp.router.weight"] is hf["model.layers.1.mlp.gate.weight"]
    fc1 = mg["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    gate, up = (
        hf["model.layers.2.mlp.experts.3.gate_proj.weight"],
        hf["model.layers.2.mlp.experts.3.up_proj.weight"],
    )
    assert torch.equal(fc1, torch.cat([gate, up])), "expert fc1 must be [gate; up]"
    back = convert.megatron_to_hf(mg, s)
    assert back.keys() == hf.keys(), sorted(set(back) ^ set(hf))
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_stacked_transformers_names_give_the_same_megatron_weights(tiny):
    """transformers 5 keeps experts stacked in memory (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    from transformers import AutoModelForCausalLM

    path, hf = tiny
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stacked = model.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in stacked
    s = convert.Shapes.from_hf(model.config)
    a, b = convert.hf_to_megatron(hf, s), convert.hf_to_megatron(stacked, s)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_te_names_keep_the_sparse_layers_pre_mlp_norm(tiny):
    s = convert.Shapes.from_hf(_cfg(tiny[0]), te_names=True)
    mg = convert.hf_to_megatron(tiny[1], s)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mg
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mg
    back = convert.megatron_to_hf(mg, s)
    assert back.keys() == tiny[1].keys()


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_parallel_shards_rebuild_the_full_model(tiny, ep):
    s = convert.Shapes.from_hf(_cfg(tiny[0]))
    full = convert.hf_to_megatron(tiny[1], s)
    local = s.num_experts // ep
    rebuilt: dict[str, torch.Tensor] = {}
    for r in range(ep):
        shard = convert.ep_shard(full, r, ep, s)
        experts = {convert.expert_of(n) for n in shard} - {None}
        assert experts == set(range(local)), f"rank {r} holds local experts {experts}"
        rebuilt |= {convert.ep_to_global(n, r, local): t for n, t in shard.items()}
    assert rebuilt.keys() == full.keys()
    assert all(rebuilt[k] is full[k] for k in full)
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert convert.ep_to_global(name, 1, 2) == name.replace(".1.linear", ".3.linear")


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_tp_shards_reassemble(tiny, tp):
    s = convert.Shapes.from_hf(_cfg(tiny[0]))
    full = convert.hf_to_megatron(tiny[1], s)
    name = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    shards = [convert.tp_shard(name, full[name], r, tp, s) for r in range(tp)]
    gate, up = full[name].chunk(2)
    assert torch.equal(shards[0], torch.cat([gate.chunk(tp)[0], up.chunk(tp)[0]])), (
        "each rank: its gate and up"
    )
    for n in (name, name.replace("fc1", "fc2"), "decoder.layers.1.mlp.router.weight"):
        parts = [convert.tp_shard(n, full[n], r, tp, s) for r in range(tp)]
        assert torch.equal(convert.tp_unshard(n, parts, s), full[n]), n
    router = "decoder.layers.1.mlp.router.weight"
    assert convert.tp_shard(router, full[router], tp - 1, tp, s) is full[router], "the router is replicated"


def test_config_fields(tiny):
    cfg = _cfg(tiny[0])
    kw = moe.config_kwargs(cfg, expert_parallel=2)
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 32
    assert kw["moe_layer_freq"] == [0, 1, 1] and kw["expert_model_parallel_size"] == 2
    assert kw["moe_router_pre_softmax"] is False, "norm_topk_prob: softmax over the top-k logits"
    assert kw["moe_aux_loss_coeff"] == 0.0 and kw["moe_enable_routing_replay"] is True
    assert "moe_token_dispatcher_type" not in kw, "model.transformer_config sets the all-to-all dispatcher"
    cfg.norm_topk_prob = False
    assert moe.config_kwargs(cfg, 1)["moe_router_pre_softmax"] is True
    assert moe.config_kwargs(types.SimpleNamespace(num_hidden_layers=2), 1) == {}


def test_moe_checks_name_the_setting(tiny):
    cfg = _cfg(tiny[0])
    moe.check(cfg)
    cfg.model_type = "qwen2_moe"
    with pytest.raises(ConfigError, match="train.backend=fsdp"):
        moe.check(cfg)


def _sample(n_tokens: int, rows: np.ndarray | None) -> Sample:
    s = Sample(0, 0, list(range(3, 3 + n_tokens - 2)), [5, 6], [1, 1], [0.0, 0.0])
    s.routed_experts = rows
    return s


def test_router_rows_follow_the_routers_token_order():
    """Token p of row b of an [s, b] batch is router token p * b_size + b; no row: -1."""
    layers, k, experts = 3, 2, 8
    shape = MoEShape(layers=[1, 2], num_hidden_layers=layers, num_experts=experts, top_k=k)
    rng = np.random.default_rng(0)
    lengths = [5, 3]
    samples = [_sample(n, rng.integers(0, experts, (n - 1, layers * k)).astype(np.uint8)) for n in lengths]
    rows = moe.router_rows(samples, [0, 1], (2, 6), shape, required=True)
    assert len(rows) == 2 and all(r.shape == (12, k) and r.dtype == torch.int32 for r in rows)
    for slot, layer in enumerate(shape.layers):
        grid = rows[slot].reshape(6, 2, k)  # [s, b, k]
        for b, (s, n) in enumerate(zip(samples, lengths, strict=True)):
            want = torch.from_numpy(s.routed_experts.reshape(n - 1, layers, k)[:, layer].astype(np.int32))
            assert torch.equal(grid[: n - 1, b], want)
            assert (grid[n - 1 :, b] == -1).all(), "last token and padding have no row"
    real = moe.real_tokens(lengths, (2, 6)).reshape(6, 2)
    assert real[:5, 0].all() and not real[5:, 0].any() and real[:3, 1].all() and not real[3:, 1].any()


def test_router_rows_of_a_packed_row():
    shape = MoEShape(layers=[0], num_hidden_layers=1, num_experts=4, top_k=1)
    a, b = _sample(4, np.array([[0], [1], [2]], np.uint8)), _sample(3, np.array([[3], [0]], np.uint8))
    rows = moe.router_rows([a, b], [0, 1], (1, 7), shape, required=True)
    assert rows[0].flatten().tolist() == [0, 1, 2, -1, 3, 0, -1]
    assert moe.router_rows([_sample(4, None)], [0], (1, 4), shape, required=False) is None
    with pytest.raises(ValueError, match="train.routing_replay"):
        moe.router_rows([_sample(4, None)], [0], (1, 4), shape, required=True)
    with pytest.raises(ValueError, match="cannot place"):
        moe.router_rows([a, b], [0, 1], (1, 5), shape, required=True)


def test_real_tokens_of_a_full_batch_is_none():
    """No padding (a full packed row, or right-padded rows all of full width): None, so the routers'
    pass is not filtered by a boolean mask; any padding gives the mask; a bad placement still fails."""
    assert moe.real_tokens([4, 3], (1, 7)) is None
    assert moe.real_tokens([5, 5], (2, 5)) is None
    assert moe.real_tokens([4, 3], (1, 8)).tolist() == [True] * 7 + [False]
    with pytest.raises(ValueError, match="cannot place"):
        moe.real_tokens([3, 3, 3, 3], (2, 6))


@pytest.mark.parametrize(
    ("layers", "stages", "first", "last", "sizes"),
    [(8, 2, None, None, [4, 4]), (8, 3, 2, None, [2, 3, 3]), (7, 3, 1, 2, [1, 4, 2]), (5, 2, 1, 4, [1, 4])],
)
def test_stage_layers(layers, stages, first, last, sizes):
    assert stage_layers(layers, stages, first, last) == sizes


@pytest.mark.parametrize(
    ("layers", "stages", "first", "last", "match"),
    [
        (6, 4, None, None, "num_hidden_layers=6, not divisible by train.pipeline_parallel=4"),
        (8, 3, 3, None, "leaves 5, which does not split evenly over the 2 stage"),
        (5, 2, 1, 3, "leaves 1"),
        (4, 2, 3, 3, "leaves -2"),
    ],
)
def test_stage_layers_refusals(layers, stages, first, last, match):
    with pytest.raises(ConfigError, match=match):
        stage_layers(layers, stages, first, last)


def test_layout_rules_for_megatron_moe(tmp_path):
    cfg = {"num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 64, "num_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    base = [f"model.path={tmp_path}", "train.backend=megatron", "train.num_ranks=4"]
    plan = resolve({}, [*base, "train.expert_parallel=4", "train.routing_replay=rollout"])
    assert plan.train.expert_parallel == 4
    with pytest.raises(ConfigError, match="needs sequence parallelism"):
        resolve({}, [*base, "train.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="train.pipeline_first_stage_layers sizes a pipeline stage"):
        resolve({}, [*base, "train.pipeline_first_stage_layers=2"])
    ok = resolve({}, [*base, "train.pipeline_parallel=4", "train.pipeline_first_stage_layers=3"])
    assert ok.train.pipeline_first_stage_layers == 3
    with pytest.raises(ConfigError, match="leaves 4, which does not split evenly over the 3"):
        resolve({}, [*base, "train.pipeline_parallel=4", "train.pipeline_last_stage_layers=2"])
