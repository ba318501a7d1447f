"""Routing replay (R3) on transformers' DeepSeek-V3 and DeepSeek-V4 routers: the patched routers give
transformers' own outputs, replaying their own choice changes nothing, replaying another choice
changes the logits while the weights stay the router's scores (normalised, scaled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.sample import Sample
from miles.train.routing_replay import RoutingReplay, find_routers, packed_routing


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v4"])
def model_dir(request, tmp_path_factory):
    from miles.models.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, seed=3)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _forward(model, tokens):
    return model(input_ids=torch.tensor([tokens]), use_cache=False).logits


def test_only_top_k_routers_are_replayed(model_dir):
    model = _load(model_dir)
    cfg = model.config
    layers = [layer for layer, _ in find_routers(model)]
    if cfg.model_type == "deepseek_v3":
        assert layers == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    else:  # hash layers choose by token id: nothing to replay
        assert layers == [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]


def test_patched_routers_reproduce_and_replay(model_dir):
    tokens = np.random.default_rng(0).integers(3, 300, 30).tolist()
    reference = _forward(_load(model_dir), tokens)
    model = _load(model_dir)
    rr = RoutingReplay.install(model, replay=True)
    seen = []
    for _, router in find_routers(model):
        router.register_forward_hook(lambda _m, _a, out: seen.append((out[2].detach(), out[1].detach())))
    with rr.batch(None, measure=False):
        assert torch.equal(_forward(model, tokens), reference)
    own = torch.stack([used for used, _ in seen], dim=1)  # [T, routers, k]
    sample = Sample(0, 0, tokens[:20], tokens[20:])
    sample.routed_experts = own[:-1].reshape(len(tokens) - 1, -1).numpy().astype(np.uint8)
    seen.clear()
    with rr.batch(packed_routing([sample], [0], rr.shape, required=True), measure=True):
        assert torch.allclose(_forward(model, tokens), reference, atol=1e-6)
    assert rr.metrics(rr.stats())["router_agreement"] == 1.0
    rng = np.random.default_rng(1)
    pairs = own[:-1].numel() // rr.shape.top_k
    other = np.stack([rng.permutation(rr.shape.num_experts)[: rr.shape.top_k] for _ in range(pairs)])
    sample.routed_experts = other.reshape(len(tokens) - 1, -1).astype(np.uint8)
    seen.clear()
    with rr.batch(packed_routing([sample], [0], rr.shape, required=True), measure=False):
        assert not torch.allclose(_forward(model, tokens), reference, atol=1e-3)
    used, weights = seen[0]
    given = torch.from_numpy(other.reshape(len(tokens) - 1, -1, rr.shape.top_k)[:, 0].astype(np.int64))
    assert torch.equal(used[:-1].sort(-1).values, given.sort(-1).values)  # the first router's rows
    scale = model.config.routed_scaling_factor
    assert torch.allclose(weights.sum(-1), torch.full((len(tokens),), scale), atol=1e-5)
