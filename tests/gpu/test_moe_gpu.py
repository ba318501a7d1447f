"""The engine's Qwen3-MoE layer on CUDA in bf16: the fused (Triton) and grouped-GEMM expert paths
against the looped and gathered ones, without host synchronisation, at decode and prefill sizes; the decoder's logits against its own fp32 CPU forward;
a decode step replayed from a CUDA graph equal to the eager one, routing table included; and a GPU
engine process returning routed experts that agree with transformers' router. Skipped without CUDA."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from miles.engine import moe
from miles.engine.model import Batch, Decoder, ModelSpec, load_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZES = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", **SIZES))


def _prefill(tokens: torch.Tensor, device: str) -> Batch:
    n = tokens.shape[0]
    ar = torch.arange(n)
    b = Batch(
        input_ids=tokens, positions=ar, write_slots=ar + 1, query_index=ar[None], query_pos=ar[None],
        context_slots=(ar + 1)[None], last_index=torch.tensor([n - 1]),
    )  # fmt: skip
    return Batch(**{k: v.to(device) for k, v in vars(b).items() if v is not None})


@pytest.mark.parametrize("T", [37, 1, 700])
def test_expert_paths_agree_and_do_not_sync(T):
    g = torch.Generator(device="cuda").manual_seed(0)
    H, inter, E, k = 256, 128, 8, 2
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    gate = torch.randn(E, H, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * inter, H, device="cuda", generator=g) / 16).bfloat16()
    down = (torch.randn(E, H, inter, device="cuda", generator=g) / 16).bfloat16()
    weights, ids = moe.route(x, gate, k, True)
    ref = moe.experts_looped(x.float(), ids, weights.float(), gate_up.float(), down.float())
    scale = float(ref.abs().max())
    if not moe.grouped_available(x, gate_up):
        pytest.skip("torch._grouped_mm does not take bf16 on this GPU (needs sm90+)")
    moe.experts_fused(x, ids, weights, gate_up, down)  # compiles the kernels outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused = moe.experts_fused(x, ids, weights, gate_up, down)
        grouped = moe.experts_grouped(x, ids, weights, gate_up, down)
        gathered = (
            moe.experts_gathered(x, ids, weights, gate_up, down) if T * k <= moe.GATHER_MAX_ROWS else fused
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, out in (("fused", fused), ("grouped", grouped), ("gathered", gathered)):
        err = float((out.float() - ref).abs().max())
        assert err <= 2e-2 * scale, f"{name}: {err} against {scale}"


def test_cuda_logits_match_the_fp32_cpu_forward(model):
    tokens = torch.randint(4, 300, (40,), generator=torch.Generator().manual_seed(1))
    cpu = Decoder(ModelSpec.from_dir(model), load_weights(model), "cpu", torch.float32)
    gpu = Decoder(ModelSpec.from_dir(model), load_weights(model), "cuda", torch.bfloat16)
    ref = cpu.forward(_prefill(tokens, "cpu"), cpu.new_kv_pool(64))
    out = gpu.forward(_prefill(tokens, "cuda"), gpu.new_kv_pool(64)).cpu()
    err = float((out - ref).abs().max())
    assert err <= 5e-2 * float(ref.abs().max()), err


def test_decode_graph_replay_equals_eager_with_routing(model):
    """A captured decode step of an MoE model (the default CUDA expert path, routing recorded into the table)
    replays with new inputs to the eager step's logits and routing."""
    from miles.engine.cuda_graph import DecodeGraphs

    dec = Decoder(ModelSpec.from_dir(model), load_weights(model), "cuda", torch.bfloat16)
    dec.record_routing = True
    pool = dec.new_kv_pool(1024)
    table = torch.arange(1, 1 + 9 * 64, device="cuda").view(9, 64)
    table[8] = 0
    graphs = DecodeGraphs(dec, pool, table, pad_row=8, max_batch=8, max_context=64)
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = torch.arange(8, device="cuda")
    for step in range(3):
        ids = torch.randint(4, 300, (8,), device="cuda", generator=g)
        positions = torch.randint(0, step + 1, (8,), device="cuda", generator=g)
        replayed = graphs.run(torch.stack([ids, positions, rows]), 64).clone()
        slots = table[rows, positions]
        routed = dec.routing_table[slots].clone()
        dec.routing_table[slots] = 0
        eager = dec.forward(Batch.decode(ids, positions, rows, table, 64), pool)
        assert float((replayed - eager).abs().max()) <= 1e-3 * float(eager.abs().max())
        assert torch.equal(routed, dec.routing_table[slots])
        assert int(routed.long().sum()) > 0


def test_gpu_engine_returns_routed_experts(model, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.engine.process import start_engine

    prompt = list(range(10, 40))
    args = ["--enable-return-routed-experts"]
    with start_engine(model, device="cuda", log_path=tmp_path / "engine.log", extra_args=args) as eng:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            "return_routed_experts": True,
        }
        out = httpx.post(eng.url + "/generate", json=body, timeout=120).json()
    layers, k = SIZES["num_hidden_layers"], SIZES["num_experts_per_tok"]
    routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), "<i4").reshape(-1, layers, k)
    tokens = prompt + out["output_ids"]
    assert routed.shape[0] == len(tokens) - 1
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([tokens[:-1]]), output_router_logits=True).router_logits
    want = np.stack([lg.topk(k, -1).indices.sort(-1).values.numpy() for lg in logits], axis=1)
    got = np.sort(routed[:, 1:], -1)  # layer 0 is dense (rows of 0)
    assert (routed[:, 0] == 0).all()
    agree = float((got == want).all(-1).mean())
    assert agree >= 0.9, f"bf16 engine routing agrees with fp32 transformers on {agree:.2%} of rows"
