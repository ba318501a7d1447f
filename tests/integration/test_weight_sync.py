"""Weight sync into a live engine process: this test process is trainer rank 0 of a gloo update group."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from miles.engine.model import load_weights
from miles.engine.process import start_engine
from miles.processes import free_port
from miles.rollout.client import SGLangClient
from miles.weights import (
    TRANSPORTS,
    DiskTransport,
    DistributedTransport,
    check_weights,
    get_transport,
    iter_buckets,
)

PROMPT = [12, 13, 14, 15]
PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("wsync") / "engine.log")
    yield proc
    proc.stop()


def _perturbed(tiny_model: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in load_weights(tiny_model).items()}


def _generate(engine) -> dict:
    return httpx.post(
        engine.url + "/generate", json={"input_ids": PROMPT, "sampling_params": PARAMS}, timeout=60
    ).json()


def test_registry_lists_known_names():
    assert set(TRANSPORTS) == {"disk", "distributed", "tensor", "lora"}
    with pytest.raises(KeyError, match="disk, distributed, tensor, lora"):
        get_transport("carrier-pigeon")


def test_every_transport_is_built_from_the_plan_by_its_name(tmp_path, tiny_model):
    """One registry lookup builds the run's transport; a LoRA run gets the lora transport, whose push
    verifies what the engines stored when weights.check is on (and no other transport's does)."""
    from miles.config import resolve
    from miles.weights import Site

    site = Site([], tmp_path, True, "127.0.0.1")
    plans = {
        "distributed": resolve({"model": {"path": tiny_model}}),
        "tensor": resolve({"model": {"path": tiny_model}, "launch": {"layout": "colocated"}}),
        "disk": resolve({"model": {"path": tiny_model}, "weights": {"transport": "disk", "check": True}}),
        "lora": resolve(
            {"model": {"path": tiny_model}, "train": {"lora": {"rank": 4}}, "weights": {"check": True}}
        ),
    }
    for name, plan in plans.items():
        assert plan.weights.transport == name
        transport = get_transport(name).from_plan(plan, site)
        assert type(transport) is TRANSPORTS[name]
        assert (plan.weights.check and type(transport).checks_in_push) == (name == "lora")
    lora = get_transport("lora").from_plan(plans["lora"], site)
    assert lora.config["r"] == 4 and lora.local and lora.check


def test_distributed_update_over_gloo(engine, tiny_model):
    before = _generate(engine)
    new = _perturbed(tiny_model, 1)
    client = SGLangClient(engine.url)

    async def run():
        transport = DistributedTransport([client], "127.0.0.1", free_port(), backend="gloo")
        await transport.setup()
        try:
            await transport.push(iter_buckets(new.items(), bucket_bytes=64 * 1024), version="3")
            mismatches = await check_weights([client], new.items())
            old = await check_weights([client], load_weights(tiny_model).items())
        finally:
            await transport.close()
        return mismatches, old

    mismatches, old = asyncio.run(run())
    assert mismatches == {}
    assert old, "check_weights must flag weights that differ"
    after = _generate(engine)
    assert after["meta_info"]["weight_version"] == "3"
    assert after["output_ids"] != before["output_ids"]


def test_disk_update(engine, tiny_model, tmp_path):
    new = _perturbed(tiny_model, 2)
    client = SGLangClient(engine.url)

    async def run():
        transport = DiskTransport([client], tmp_path / "weights", template_dir=tiny_model)
        await transport.setup()
        await transport.push(iter_buckets(new.items(), bucket_bytes=32 * 1024), version="4")
        first = transport.current
        await transport.push(iter_buckets(new.items(), bucket_bytes=32 * 1024), version="5")
        return (
            first,
            transport.current,
            await check_weights([client], new.items()),
            await client.get_weight_version(),
        )

    first, current, mismatches, version = asyncio.run(run())
    assert mismatches == {} and version == "5"
    assert not first.exists() and len(list(current.glob("*.safetensors"))) > 1
    assert (current / "config.json").exists()
    assert _generate(engine)["meta_info"]["weight_version"] == "5"


def test_tensor_update_by_shared_memory(engine, tiny_model):
    """TensorTransport: buckets packed into flat buffers, handed over by reference (shared memory on
    CPU, CUDA IPC on GPU), loaded exactly, versioned; the output changes with the weights."""
    before = _generate(engine)["output_ids"]
    new = _perturbed(tiny_model, 3)
    client = SGLangClient(engine.url)

    async def run():
        transport = get_transport("tensor")([client])
        await transport.setup()
        await transport.push(iter_buckets(new.items(), bucket_bytes=64 * 1024), version="7")
        return await check_weights([client], new.items()), await client.get_weight_version()

    mismatches, version = asyncio.run(run())
    assert mismatches == {} and version == "7"
    reply = _generate(engine)
    assert reply["meta_info"]["weight_version"] == "7" and reply["output_ids"] != before


@pytest.mark.parametrize(
    "body",
    [
        {"serialized_named_tensors": ["not base64 pickle"]},
        {"serialized_named_tensors": []},
        {"serialized_named_tensors": ["gASVAwAAAAAAAABLAS4="]},  # a pickled int, not (name, tensor) pairs
        {"names": ["x"]},
    ],
)
def test_bad_tensor_update_is_a_400(engine, body):
    reply = httpx.post(engine.url + "/update_weights_from_tensor", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert "serialized_named_tensors" in reply.text
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
