"""End to end on CPU with a tiny Qwen3-MoE model: the embedded engine returns routed experts, the FSDP
trainer replays them (train.routing_replay=rollout), weights go back under per-expert names.

The run is a real `miles train` child process; the test reads what it left in metrics.jsonl.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "tiny-moe", arch="qwen3_moe", seed=0))


def test_routing_replay_loop(recipe, tiny_moe) -> None:
    steps = 3
    path, run_dir = recipe(
        model={"path": tiny_moe},
        rollout={"schedule": "sync", "max_new_tokens": 4},
        train={"steps": steps, "routing_replay": "rollout", "checkpoint": {"every_steps": 0}},
        weights={"check": True},
    )
    finish(miles_train(str(path)), timeout_s=400)
    records = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["train/router_agreement"] == 1.0  # every token and MoE layer took the engine's experts
        assert 0.0 <= r["train/router_natural_agreement"] <= 1.0
        assert r["train/moe_load_imbalance"] >= 1.0
        assert r["train/moe_aux_loss"] > 0
        assert r["weights/check_max_diff"] == 0.0  # the engine holds the trainer's (per-expert) weights
    assert records[0]["train/logprob_mismatch"] < 1e-3


def test_engine_rows_decode_and_the_trainer_router_agrees_without_replay(tiny_moe, tmp_path) -> None:
    """The real engine's routed experts through the client: the documented shape, dense layer 0 all
    zero; the same weights in transformers route (without replay) like the engine almost everywhere."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from miles.engine.process import start_engine
    from miles.rollout.client import SGLangClient
    from miles.sample import Sample
    from miles.train.routing_replay import RoutingReplay, packed_routing

    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    cfg = model.config
    prompts = [[5, 17, 42, 8, 99, 23], [7, 7, 130, 2]]

    async def generate(url: str):
        client = SGLangClient(url)
        try:
            params = {"max_new_tokens": 6, "temperature": 1.0}
            return [await client.generate(p, params, return_routed_experts=True) for p in prompts]
        finally:
            await client.aclose()

    with start_engine(
        tiny_moe, log_path=tmp_path / "engine.log", extra_args=["--enable-return-routed-experts"]
    ) as eng:
        results = asyncio.run(generate(eng.url))
    samples = []
    for i, (prompt, r) in enumerate(zip(prompts, results, strict=True)):
        rows = r.routed_experts
        assert rows.shape == (
            len(prompt) + len(r.output_ids) - 1,
            cfg.num_hidden_layers * cfg.num_experts_per_tok,
        )
        assert rows.dtype == np.uint8 and int(rows.max()) < cfg.num_experts
        assert not rows.reshape(len(rows), cfg.num_hidden_layers, -1)[:, 0].any()  # layer 0 is dense
        s = Sample(0, i, prompt, list(r.output_ids), [1] * len(r.output_ids), list(r.logprobs))
        s.routed_experts = rows
        samples.append(s)
    rr = RoutingReplay.install(model, replay=False)
    with torch.no_grad(), rr.batch(packed_routing(samples, [0, 1], rr.shape, required=False), measure=True):
        ids = [t for s in samples for t in s.tokens]
        pos = [p for s in samples for p in range(len(s.tokens))]
        model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False)
    metrics = rr.metrics(rr.stats())
    assert metrics["router_agreement"] == metrics["router_natural_agreement"] >= 0.9, metrics
