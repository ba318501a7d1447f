"""FP8 weight sync into a live FP8 engine: the trainer's contract pairs travel through every transport
and the engine's /weights_checker checksums equal the trainer's bytes; FSDP2 ranks over gloo run the
fake-quant forward and export the pairs; Megatron's tensor-parallel fake quant over gloo ranks."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch
import torch.distributed as dist
from test_fsdp_ranks import TRAIN, probe_ids, run_ranks

from miles.engine.model import load_weights
from miles.engine.process import start_engine
from miles.processes import free_port
from miles.quant.fp8 import dequantize_weight, is_quantized_name, scale_name
from miles.rollout.client import SGLangClient
from miles.train.quant import export_pairs
from miles.weights import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    check_checksums,
    engine_checksums,
    iter_buckets,
)

LAYOUT = "fp8_block"


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("fp8sync") / "engine.log"
    proc = start_engine(tiny_model, device="cpu", log_path=log, extra_args=["--quantization", LAYOUT])
    yield proc
    proc.stop()


def _pairs(tiny_model: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Perturbed weights of the tiny model in the wire layout of an FP8 engine."""
    gen = torch.Generator().manual_seed(seed)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in load_weights(tiny_model).items()}
    return list(export_pairs(new.items(), LAYOUT))


def _transport(kind: str, client: SGLangClient, tmp_path, tiny_model: str):
    if kind == "disk":
        return DiskTransport([client], tmp_path / "weights", template_dir=tiny_model, quantization=LAYOUT)
    if kind == "tensor":
        return TensorTransport([client])
    return DistributedTransport([client], "127.0.0.1", free_port(), backend="gloo")


def _generate(engine) -> dict:
    body = {"input_ids": [12, 13, 14, 15], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    return httpx.post(engine.url + "/generate", json=body, timeout=60).json()


@pytest.mark.parametrize("kind,seed", [("disk", 1), ("tensor", 2), ("distributed", 3)])
def test_fp8_sync_leaves_engine_bytes_equal_to_trainer_bytes(engine, tiny_model, tmp_path, kind, seed):
    pairs = _pairs(tiny_model, seed)
    assert sum(t.dtype == torch.float8_e4m3fn for _, t in pairs) == 14  # 2 layers x 7 projections
    client = SGLangClient(engine.url)

    async def run():
        transport = _transport(kind, client, tmp_path, tiny_model)
        await transport.setup()
        try:
            await transport.push(iter_buckets(iter(pairs), bucket_bytes=48 * 1024), version=f"{kind}-{seed}")
            same = await check_checksums([client], pairs)
            stale = await check_checksums([client], _pairs(tiny_model, seed + 10))
            stored = await engine_checksums(client)
        finally:
            await transport.close()
            await client.aclose()
        return same, stale, stored

    same, stale, stored = asyncio.run(run())
    assert same == {}, same
    assert {n for n, _ in pairs} <= set(stored)
    # the check can fail: other bytes are flagged, naming the engine and the tensor
    assert f"{engine.url}:model.layers.0.self_attn.q_proj.weight" in stale
    assert f"{engine.url}:model.layers.0.self_attn.q_proj.weight_scale_inv" in stale
    reply = _generate(engine)
    assert reply["meta_info"]["weight_version"] == f"{kind}-{seed}"
    if kind == "disk":
        import json

        config = json.loads((tmp_path / "weights" / f"v{kind}-{seed}" / "config.json").read_text())
        assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_fsdp_ranks_fake_quant_forward_and_fp8_export(engine, tiny_model, tmp_path):
    """2 FSDP2 ranks over gloo train with the fake-quant forward; the exported pairs, dequantised into
    a plain HF model, reproduce the trainer's logits, and pushed to the engine they match its bytes."""
    from transformers import AutoModelForCausalLM

    config = {
        "model": {"path": tiny_model, "init_tiny_if_missing": False},
        "run": {"runs_root": str(tmp_path), "name": "fq"},
        "engine": {"quantization": LAYOUT},
        "train": {**TRAIN, "steps": 2, "device": "cpu", "quantization": "fake_quant"},
    }
    job = {
        "config": config,
        "actions": [["train", [0, 1]]],
        "bucket_bytes": 40_000,
        "out": str(tmp_path / "fq"),
    }
    result = run_ranks(2, job, tmp_path / "fq")
    assert all(
        torch.isfinite(torch.tensor(m["loss"])) and "tis_clip_seq_frac" in m for m in result["metrics"]
    )
    weights, logits = result["tensors"]["weights"], result["tensors"]["logits"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    state = {}
    for name, t in weights.items():
        if name.endswith("_scale_inv"):
            continue
        if is_quantized_name(name):
            assert t.dtype == torch.float8_e4m3fn, name
            t = dequantize_weight(t, weights[scale_name(name)], LAYOUT, torch.float32)
        state[name] = t
    hf.load_state_dict(state, strict=True)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([probe_ids()]), use_cache=False).logits[0]
    assert (ref - logits).abs().max() <= 1e-5
    client = SGLangClient(engine.url)

    async def push():
        transport = DistributedTransport([client], "127.0.0.1", free_port(), backend="gloo")
        await transport.setup()
        try:
            await transport.push(iter_buckets(weights.items(), bucket_bytes=40_000), version="fsdp-fq")
            return await check_checksums([client], weights.items())
        finally:
            await transport.close()
            await client.aclose()

    assert asyncio.run(push()) == {}


def _tp_worker(rank: int, port: int, full: dict[str, torch.Tensor], out: str) -> None:
    from miles.train.megatron import convert
    from miles.train.megatron.quant import fake_quant_local

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    s = _SHAPES
    try:
        got = {
            name: fake_quant_local(name, convert.tp_shard(name, t, rank, 2, s), LAYOUT, s, rank, 2, None)
            for name, t in full.items()
        }
        torch.save(got, f"{out}.{rank}.pt")
    finally:
        dist.destroy_process_group()


def _shapes():
    from miles.train.megatron import convert

    return convert.Shapes(
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=48, hidden=192, vocab=300, tied=False
    )


_SHAPES = _shapes()


def test_megatron_tensor_parallel_fake_quant_equals_hf_fake_quant(tmp_path):
    """Each of 2 tensor-parallel ranks (gloo) gets the slice of the Megatron weight packed from the
    contract's fake-quant of the HF pieces; the slices put together equal it bitwise."""
    import torch.multiprocessing as mp

    from miles.quant.fp8 import fake_quant
    from miles.train.megatron import convert

    s = _SHAPES
    gen = torch.Generator().manual_seed(0)
    hf = {
        f"model.layers.0.{n}": torch.randn(shape, generator=gen)
        * torch.linspace(0.1, 4, shape[0]).unsqueeze(1)
        for n, shape in {
            "self_attn.q_proj.weight": (192, 192),
            "self_attn.k_proj.weight": (96, 192),
            "self_attn.v_proj.weight": (96, 192),
            "self_attn.o_proj.weight": (192, 192),
            "mlp.gate_proj.weight": (320, 192),
            "mlp.up_proj.weight": (320, 192),
            "mlp.down_proj.weight": (192, 320),
        }.items()
    }
    full = {
        k: v
        for k, v in convert.hf_to_megatron({**hf, **_norms()}, s).items()
        if k.startswith("decoder.layers.0.") and ("linear" in k)
    }
    assert len(full) == 4
    out = str(tmp_path / "tp")
    mp.spawn(_tp_worker, args=(free_port(), full, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}.pt") for r in range(2)]
    want = convert.hf_to_megatron({**{k: fake_quant(v, LAYOUT) for k, v in hf.items()}, **_norms()}, s)
    for name in full:
        joined = convert.tp_unshard(name, [ranks[0][name], ranks[1][name]], s)
        assert torch.equal(joined, want[name]), name
        assert not torch.equal(joined, full[name])


def _norms() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.zeros(300, 192),
        "model.norm.weight": torch.ones(192),
        "lm_head.weight": torch.zeros(300, 192),
        "model.layers.0.input_layernorm.weight": torch.ones(192),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(192),
    }
