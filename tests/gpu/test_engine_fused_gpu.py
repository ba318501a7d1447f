"""The decoder's fused CUDA forward (fused q/k/v and gate/up GEMMs, Triton kernels of
miles/engine/triton_fused.py) against its per-op CUDA forward (`Decoder.fused = False`), in bf16 on
Qwen2 / Qwen3 / Llama-shaped random models: logits of a prefill and of decode steps, the K/V written
to the pool, a decode step replayed from a CUDA graph, the kernel count of a decode step, and the
fused storage under weight updates by HF name and an offload/onload round trip. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from miles.engine.model import Batch, Decoder, ModelSpec, load_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels, bf16)"),
]

SIZES = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=4, num_attention_heads=8)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def model(request, tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    out = tmp_path_factory.mktemp(request.param) / "m"
    return str(init_tiny(out, arch=request.param, num_key_value_heads=2, **SIZES))


def _decoder(model: str, fused: bool = True) -> Decoder:
    dec = Decoder(ModelSpec.from_dir(model), load_weights(model), "cuda", torch.bfloat16)
    dec.fused = fused
    return dec


def _steps(dec: Decoder, pool, n_decode: int = 3) -> list[torch.Tensor]:
    """Logits of a prefill of 3 requests (prompts of 7, 1 and 30 tokens), then of n_decode decode
    steps of all three (the paged attention path) over fixed random tokens."""
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([7, 1, 30])
    width = int(lens.max()) + n_decode
    table = torch.arange(1, 1 + len(lens) * width).view(len(lens), width)  # slot 0 is padding
    starts = lens.cumsum(0) - lens
    j = torch.arange(int(lens.max()))
    valid = j[None, :] < lens[:, None]
    owner = torch.repeat_interleave(torch.arange(len(lens)), lens)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    pre = Batch(
        input_ids=torch.randint(4, 300, (int(lens.sum()),), generator=g), positions=positions,
        write_slots=table[owner, positions], query_index=torch.where(valid, starts[:, None] + j, 0),
        query_pos=torch.where(valid, j, -1), context_slots=table[:, : int(lens.max())],
        last_index=starts + lens - 1,
    )  # fmt: skip
    pre = Batch(**{k: v.to(dec.device) for k, v in vars(pre).items() if v is not None})
    out = [dec.forward(pre, pool)]
    tokens = torch.randint(4, 300, (n_decode, len(lens)), generator=g).to(dec.device)
    table, rows = table.to(dec.device), torch.arange(len(lens), device=dec.device)
    for step in range(n_decode):
        b = Batch.decode(tokens[step], lens.to(dec.device) + step, rows, table, width)
        out.append(dec.forward(b, pool))
    return out


USED_SLOTS = 1 + 3 * (30 + 3)  # slots 1.. of _steps' table; slot 0 is padding, never written


def test_fused_forward_matches_per_op(model):
    dec = _decoder(model)
    pools, logits = {}, {}
    for fused in (True, False):
        dec.fused = fused
        pools[fused] = dec.new_kv_pool(256)
        logits[fused] = _steps(dec, pools[fused])
    for step, (a, b) in enumerate(zip(logits[True], logits[False], strict=True)):
        err = float((torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max())
        print(f"{dec.spec.arch} step {step}: fused vs per-op max |log-prob diff| {err:.2e}")
        # the same roundings up to GEMM accumulation order and the norms' sums of squares
        assert a.dtype == torch.float32 and a.shape == b.shape and err <= 0.05, (step, err)
    for (k1, v1), (k2, v2) in zip(pools[True], pools[False], strict=True):
        for x, y in ((k1, k2), (v1, v2)):
            assert float((x.float() - y.float()).abs().max()) <= 0.02 * float(y.float().abs().max())
            assert (x[:, 0] == 0).all() and (x[:, USED_SLOTS:] == 0).all(), "K/V written outside the slots"


def test_fused_decode_in_cuda_graph_equals_eager(model):
    """Replays of a captured fused decode step, with new inputs each time, against eager forwards of
    the same shape (batch 8 = a graph bucket, so no padding rows)."""
    from miles.engine.cuda_graph import DecodeGraphs

    dec = _decoder(model)
    pool = dec.new_kv_pool(1024)
    table = torch.arange(1, 1 + 9 * 64, device="cuda").view(9, 64)
    table[8] = 0  # the padding row: the scratch slot
    graphs = DecodeGraphs(dec, pool, table, pad_row=8, max_batch=8, max_context=64)
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = torch.arange(8, device="cuda")
    for step in range(4):
        ids = torch.randint(4, 300, (8,), device="cuda", generator=g)
        positions = torch.randint(0, step + 1, (8,), device="cuda", generator=g)
        replayed = graphs.run(torch.stack([ids, positions, rows]), 64).clone()
        eager = dec.forward(Batch.decode(ids, positions, rows, table, 64), pool)
        err = float((replayed - eager).abs().max())
        assert err <= 1e-3 * float(eager.abs().max()), (
            f"step {step}: graph replay differs from eager by {err}"
        )
    assert len(graphs.graphs) == 1


def test_fused_decode_launches_half_the_kernels(model):
    from torch.profiler import ProfilerActivity, profile

    dec = _decoder(model)
    pool = dec.new_kv_pool(1024)
    table = torch.arange(1, 1 + 16 * 64, device="cuda").view(16, 64)
    b = Batch.decode(
        *torch.randint(4, 60, (2, 16), device="cuda"), torch.arange(16, device="cuda"), table, 64
    )
    counts = {}
    for fused in (True, False):
        dec.fused = fused
        dec.forward(b, pool)  # compile / warm up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.forward(b, pool)
            torch.cuda.synchronize()
        counts[fused] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    layers = dec.spec.num_layers
    print(f"kernels per decode step: fused {counts[True]}, per-op {counts[False]} ({layers} layers)")
    assert counts[True] <= counts[False] / 2 and counts[True] <= 14 * layers + 16, counts


def test_weight_update_by_name_lands_in_fused_storage(model):
    dec = _decoder(model)
    weights = load_weights(model)
    g = torch.Generator().manual_seed(2)
    names = [n for n in weights if n.startswith("model.layers.1.") and ("_proj" in n)]
    update = {n: weights[n] + 0.05 * torch.randn(weights[n].shape, generator=g) for n in names}
    qkv = dec.storage["model.layers.1.self_attn.qkv_proj.weight"]
    before = qkv.data_ptr()
    dec.load(update)  # partial: a few names of one layer
    assert dec.storage["model.layers.1.self_attn.qkv_proj.weight"].data_ptr() == before
    for n, t in update.items():
        assert torch.equal(dec.get(n), t.to("cuda", torch.bfloat16)), n
    rows = dec.spec.num_heads * dec.spec.head_dim
    assert torch.equal(qkv[:rows], update["model.layers.1.self_attn.q_proj.weight"].cuda().bfloat16())
    fresh = _decoder(model)
    fresh.load(update)
    a, b = _steps(dec, dec.new_kv_pool(256)), _steps(fresh, fresh.new_kv_pool(256))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), "update by name != same weights loaded"


def test_offload_onload_round_trip_with_fused_storage(model):
    dec = _decoder(model)
    before = _steps(dec, dec.new_kv_pool(256))
    torch.cuda.synchronize()
    alloc = torch.cuda.memory_allocated()
    weight_bytes = sum(t.numel() * t.element_size() for t in dec.storage.values())
    assert weight_bytes == sum(t.numel() * t.element_size() for t in dec.params.values())
    dec.offload()
    assert alloc - torch.cuda.memory_allocated() >= weight_bytes
    assert all(not t.is_cuda and t.is_pinned() for t in dec.params.values())
    host = {k: t.data_ptr() for k, t in dec.storage.items()}
    name = "model.layers.0.mlp.up_proj.weight"  # an update while offloaded lands in the pinned copy
    new_up = torch.randn(dec.get(name).shape, generator=torch.Generator().manual_seed(3)) * 0.02
    dec.load({name: new_up})
    dec.onload()
    assert all(t.is_cuda for t in dec.params.values())
    up_rows = dec.get("model.layers.0.mlp.gate_proj.weight").shape[0]
    gate_up = dec.storage["model.layers.0.mlp.gate_up_proj.weight"]
    assert dec.get(name).data_ptr() == gate_up[up_rows:].data_ptr(), "views rebuilt over the device copy"
    assert torch.equal(dec.get(name), new_up.cuda().bfloat16())
    dec.load({name: load_weights(model)[name]})
    assert all(torch.equal(x, y) for x, y in zip(_steps(dec, dec.new_kv_pool(256)), before, strict=True))
    dec.offload()
    assert {k: t.data_ptr() for k, t in dec.storage.items()} == host, "pinned buffers are reused"
