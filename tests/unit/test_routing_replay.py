"""Rollout routing replay (R3) on a tiny transformers Qwen3-MoE model, the routed-experts wire format,
and routed experts on samples through the buffer and the rank broadcast (pickle)."""

from __future__ import annotations

import base64
import json
import pickle

import numpy as np
import pytest
import torch

from miles.config import ConfigError, layout, resolve
from miles.rollout.buffer import RolloutBuffer
from miles.rollout.client import GenerateResult, decode_routed_experts
from miles.sample import Sample
from miles.train.fsdp.weights import iter_full_tensors
from miles.train.routing_replay import RoutingReplay, find_routers, packed_routing, per_layer_rows

LAYERS, EXPERTS, TOP_K = 3, 8, 2


def tiny_moe(seed: int = 0, norm: bool = True, sparse_step: int = 1):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm,
        decoder_sparse_step=sparse_step,
        max_position_embeddings=64,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # transformers initialises routers to zero: give them a real choice to make
        for _, router in find_routers(model):
            router.weight.normal_(0, 0.5)
    return model


def make_samples(rng: np.random.Generator, lengths=((5, 4), (3, 6))) -> list[Sample]:
    out = []
    for i, (p, r) in enumerate(lengths):
        n = p + r
        rows = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range((n - 1) * LAYERS)])
        s = Sample(i, 0, rng.integers(0, 61, p).tolist(), rng.integers(0, 61, r).tolist())
        s.routed_experts = rows.reshape(n - 1, LAYERS * TOP_K).astype(np.uint8)
        out.append(s)
    return out


def forward(model, samples, indices=(0, 1)):
    ids = [t for i in indices for t in samples[i].tokens]
    pos = [p for i in indices for p in range(len(samples[i].tokens))]
    return model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False).logits


def capture(model):
    """Indices and weights each router returns, per router, in forward order."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _, router in find_routers(model):
        router.register_forward_hook(lambda m, a, out: seen.append((out[2].detach(), out[1])))
    return seen


def test_replay_uses_the_given_routing_for_every_token_and_layer():
    model = tiny_moe()
    samples = make_samples(np.random.default_rng(0))
    rr = RoutingReplay.install(model, replay=True)
    seen = capture(model)
    routing = packed_routing(samples, [0, 1], rr.shape, required=True)
    with rr.batch(routing, measure=True):
        forward(model, samples)
    given, valid = routing
    for slot, (used, _) in enumerate(seen):
        assert torch.equal(used[valid], given[valid, slot])
    metrics = rr.metrics(rr.stats())
    assert metrics["router_agreement"] == 1.0
    assert metrics["router_natural_agreement"] < 1.0  # random routing is not what the router picks
    assert valid.sum() == sum(len(s.tokens) - 1 for s in samples)


def test_without_replay_agreement_is_measured():
    model = tiny_moe()
    samples = make_samples(np.random.default_rng(1))
    rr = RoutingReplay.install(model, replay=False)
    routing = packed_routing(samples, [0, 1], rr.shape, required=False)
    with rr.batch(routing, measure=True):
        forward(model, samples)
    random_routing = rr.metrics(rr.stats())
    assert 0.0 <= random_routing["router_agreement"] < 1.0
    assert random_routing["router_agreement"] == random_routing["router_natural_agreement"]
    # the model's own choice given back as the rollout's: full agreement without replay
    seen = capture(model)
    with rr.batch(None, measure=False):
        forward(model, samples)
    own = torch.stack([used for used, _ in seen], dim=1)  # [T, layers, k]
    for s, (start, n) in zip(samples, ((0, 9), (9, 9)), strict=True):
        s.routed_experts = own[start : start + n - 1].reshape(n - 1, -1).numpy().astype(np.uint8)
    rr.reset()
    with rr.batch(packed_routing(samples, [0, 1], rr.shape, required=False), measure=True):
        forward(model, samples)
    assert rr.metrics(rr.stats())["router_agreement"] == 1.0


def test_replaying_the_routers_own_choice_gives_transformers_logits():
    reference = forward(tiny_moe(), make_samples(np.random.default_rng(2)))
    model = tiny_moe()
    samples = make_samples(np.random.default_rng(2))
    rr = RoutingReplay.install(model, replay=True)
    seen = capture(model)
    with rr.batch(None, measure=False):
        assert torch.equal(forward(model, samples), reference)
    own = torch.stack([used for used, _ in seen], dim=1)
    offset = 0
    for s in samples:
        n = len(s.tokens)
        s.routed_experts = own[offset : offset + n - 1].reshape(n - 1, -1).numpy().astype(np.uint8)
        offset += n
    with rr.batch(packed_routing(samples, [0, 1], rr.shape, required=True), measure=False):
        assert torch.allclose(forward(model, samples), reference, atol=1e-6)
    with rr.batch(packed_routing(make_samples(np.random.default_rng(3)), [0, 1], rr.shape, True), False):
        assert not torch.allclose(forward(model, samples), reference, atol=1e-3)


def test_router_gets_gradients_under_replay():
    model = tiny_moe()
    samples = make_samples(np.random.default_rng(4))
    rr = RoutingReplay.install(model, replay=True)
    with rr.batch(packed_routing(samples, [0, 1], rr.shape, required=True), measure=False):
        forward(model, samples).logsumexp(-1).sum().backward()
    for _, router in find_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_weights_are_router_probabilities_renormalised(norm):
    model = tiny_moe(norm=norm)
    samples = make_samples(np.random.default_rng(5))
    rr = RoutingReplay.install(model, replay=True)
    inputs: list[torch.Tensor] = []
    for _, router in find_routers(model):
        router.register_forward_hook(lambda m, a, out: inputs.append(out))
    with rr.batch(packed_routing(samples, [0, 1], rr.shape, required=True), measure=False):
        forward(model, samples)
    for logits, weights, used in inputs:
        probs = torch.softmax(logits.float(), dim=-1).gather(1, used)
        expected = probs / probs.sum(-1, keepdim=True) if norm else probs
        assert torch.allclose(weights, expected, atol=1e-6)
        if norm:
            assert torch.allclose(weights.sum(-1), torch.ones(len(weights)), atol=1e-6)


def test_dense_first_layers_take_their_rows_by_layer_index():
    model = tiny_moe(sparse_step=2)  # only layer 1 is sparse
    rr = RoutingReplay.install(model, replay=True)
    assert rr.shape.layers == [1] and rr.shape.num_hidden_layers == LAYERS
    samples = make_samples(np.random.default_rng(6))
    routing, valid = packed_routing(samples, [1], rr.shape, required=True)
    rows = samples[1].routed_experts.reshape(-1, LAYERS, TOP_K)[:, 1]
    assert torch.equal(routing[: len(rows), 0], torch.from_numpy(rows.astype(np.int64)))


def test_missing_or_misshapen_rows_are_refused():
    model = tiny_moe()
    rr = RoutingReplay.install(model, replay=True)
    samples = make_samples(np.random.default_rng(7))
    samples[0].routed_experts = None
    with pytest.raises(ValueError, match="train.routing_replay"):
        packed_routing(samples, [0, 1], rr.shape, required=True)
    assert packed_routing(samples, [0], rr.shape, required=False) is None
    samples[1].routed_experts = samples[1].routed_experts[:-1]
    with pytest.raises(ValueError, match="one row per token but the last"):
        packed_routing(samples, [1], rr.shape, required=True)


def test_per_layer_rows_for_megatron():
    samples = make_samples(np.random.default_rng(8))
    rr = RoutingReplay.install(tiny_moe(), replay=True)
    routing, valid = packed_routing(samples, [0, 1], rr.shape, required=True)
    rows = per_layer_rows(routing, valid, pad_to=8)
    assert len(rows) == LAYERS and all(r.shape == (24, TOP_K) and r.dtype == torch.int32 for r in rows)
    total = routing.shape[0]
    assert (rows[0][total:] == -1).all() and (rows[2][:total][~valid] == -1).all()
    assert torch.equal(rows[2][:total][valid], routing[valid, 2].int())


def test_expert_load_and_imbalance():
    model = tiny_moe()
    samples = make_samples(np.random.default_rng(9))
    rr = RoutingReplay.install(model, replay=False)
    with rr.batch(None, measure=True):
        forward(model, samples)
    m = rr.metrics(rr.stats())
    loads = [m[f"moe_expert_load/{e}"] for e in range(EXPERTS)]
    assert sum(loads) == pytest.approx(1.0)
    assert m["moe_load_imbalance_max"] >= m["moe_load_imbalance"] >= 1.0
    assert m["moe_aux_loss"] > 0
    assert "router_agreement" not in m  # nothing to compare with


def test_wire_format_decodes_to_rows_layers_top_k():
    prompt, completion = 7, 5
    ids = np.random.default_rng(10).integers(0, EXPERTS, (prompt + completion - 1, LAYERS, TOP_K))
    text = base64.b64encode(ids.astype("<i4").tobytes(order="C")).decode()
    reply = {
        "text": "",
        "output_ids": list(range(completion)),
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "stop"},
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "output_token_logprobs": [[-0.5, t, None] for t in range(completion)],
            "routed_experts": text,
        },
    }
    r = GenerateResult.from_reply(reply)
    assert r.routed_experts.shape == (prompt + completion - 1, LAYERS * TOP_K)
    assert r.routed_experts.dtype == np.uint8
    assert np.array_equal(r.routed_experts.reshape(-1, LAYERS, TOP_K), ids)
    assert "routed_experts" not in r.meta_info
    big = decode_routed_experts(base64.b64encode(np.array([[300, 2]], "<i4").tobytes()).decode(), 1)
    assert big.dtype == np.int16 and big.tolist() == [[300, 2]]
    with pytest.raises(ValueError, match="whole number of rows"):
        decode_routed_experts(text, prompt + completion)


def test_sample_with_routed_experts_survives_buffer_and_broadcast():
    samples = make_samples(np.random.default_rng(11))
    buf = RolloutBuffer(capacity=2)
    assert buf.put(samples)
    (group,) = buf.get(1, current_version=0)
    copy = pickle.loads(pickle.dumps(group))  # what the loop's broadcast to trainer ranks does
    for before, after in zip(samples, copy, strict=True):
        assert after.routed_experts.dtype == np.uint8
        assert np.array_equal(after.routed_experts, before.routed_experts)


def test_exported_names_are_the_checkpoint_names(tmp_path):
    from safetensors import safe_open

    model = tiny_moe()
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    exported = dict(iter_full_tensors(model))
    assert set(exported) == set(on_disk)
    for name, tensor in exported.items():
        assert torch.equal(tensor, on_disk[name]), name


def _moe_config(tmp_path, experts: int) -> str:
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 64, "num_experts": experts}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_layout_refuses_replay_on_a_dense_model(tmp_path):
    path = _moe_config(tmp_path, 0)
    for backend in ("fsdp", "megatron"):
        with pytest.raises(
            ConfigError, match="train.routing_replay=rollout needs a mixture-of-experts model"
        ):
            resolve({}, [f"model.path={path}", "train.routing_replay=rollout", f"train.backend={backend}"])
    moe = _moe_config(tmp_path, 8)
    for backend in ("fsdp", "megatron"):
        plan = resolve({}, [f"model.path={moe}", "train.routing_replay=rollout", f"train.backend={backend}"])
        assert plan.train.routing_replay == "rollout"


def test_expert_parallel_divides_experts_and_data_parallel_ranks(tmp_path):
    plan = resolve({}, [f"model.path={_moe_config(tmp_path, 6)}"])
    ep4 = plan.model_copy(update={"train": plan.train.model_copy(update={"expert_parallel": 4})})
    with pytest.raises(ConfigError, match="6 routed experts, not divisible by train.expert_parallel=4"):
        layout._check_experts(ep4, layout._model_shape(plan.model.path))
    with pytest.raises(
        ConfigError, match="train.expert_parallel=4 does not divide the 6 data-parallel ranks"
    ):
        layout._check_ranks(ep4, 6, "train.num_ranks")
    layout._check_ranks(ep4, 8, "train.num_ranks")
    dense = plan.model_copy(update={"train": ep4.train, "model": plan.model.model_copy(update={"path": "x"})})
    with pytest.raises(ConfigError, match="is dense: set train.expert_parallel=1"):
        layout._check_experts(dense, {"num_experts": 0})


@pytest.fixture(scope="module")
def process_group():
    from miles.cluster.distributed import teardown_distributed

    yield
    teardown_distributed()


def test_fsdp_backend_trains_checkpoints_and_exports_moe(tmp_path, process_group):
    from safetensors import safe_open

    from miles.models.tiny import init_tiny
    from miles.train import get_backend

    path = init_tiny(tmp_path / "tiny-moe", arch="qwen3_moe", seed=0)
    run_dir = tmp_path / "runs" / "moe"
    overrides = {"device": "cpu", "steps": 4, "routing_replay": "rollout", "lr": 1e-2}
    plan = resolve(
        {
            "model": {"path": str(path)},
            "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
            "train": overrides,
        }
    )
    backend = get_backend("fsdp")()
    backend.setup(plan)
    cfg = backend.model.config
    rng = np.random.default_rng(12)
    samples = []
    for i, reward in enumerate((1.0, 0.0, 1.0, 0.0)):
        prompt, response = rng.integers(3, 300, 6).tolist(), rng.integers(3, 300, 3).tolist()
        s = Sample(0, i, prompt, response, [1] * 3, [-1.0] * 3, reward=reward)
        rows = [
            rng.permutation(cfg.num_experts)[: cfg.num_experts_per_tok]
            for _ in range(8 * cfg.num_hidden_layers)
        ]
        s.routed_experts = np.stack(rows).reshape(8, -1).astype(np.uint8)
        samples.append(s)
    metrics = backend.train(samples)
    assert metrics["router_agreement"] == 1.0 and metrics["moe_load_imbalance"] >= 1.0
    backend.save(1)
    saved = {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}
    backend.train(samples)
    moved = {n: t for bucket in backend.export_weights(1 << 20) for n, t in bucket}
    assert any(not torch.equal(saved[n], moved[n]) for n in saved if ".experts." in n)
    backend.load(1)
    restored = {n: t for bucket in backend.export_weights(1 << 20) for n, t in bucket}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert set(restored) == set(f.keys())  # the per-expert names of the HF checkpoint
    for name, tensor in restored.items():
        assert torch.equal(tensor, saved[name]), name
    samples[0].routed_experts = None
    with pytest.raises(ValueError, match="train.routing_replay"):
        backend.train(samples)
