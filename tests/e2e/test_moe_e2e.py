"""End to end on CPU with a tiny Qwen3-MoE model: the embedded engine returns routed experts, the FSDP
trainer replays them (train.routing_replay=rollout), weights go back under per-expert names.

The run is a real `miles train` child process; the test reads what it left in metrics.jsonl.
"""

from __future__ import annotations

import pytest
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
