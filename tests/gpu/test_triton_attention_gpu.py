"""The paged decode-attention kernel on a CUDA GPU against the decoder's gather + SDPA path, at the
engine's full decode shape: batch 256, context 640, Qwen2.5-0.5B heads (14 q heads, 2 kv heads,
head_dim 64), in fp32 and bf16, with one and several key splits; and inside a CUDA graph whose inputs
change between replays. Slots that only padding positions point at hold NaN, so reading a key past
a query's position shows. Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel on device)"),
]

B, H, KVH, D, L = 256, 14, 2, 64, 640


def _problem(dtype: torch.dtype, seed: int = 0):
    """Inputs at the full decode shape, the NaN-poisoned pools the kernel reads, and clean pools."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots_total = B * L + 1
    q = torch.randn(B, H, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(KVH, slots_total, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(KVH, slots_total, D, device="cuda", generator=gen).to(dtype)
    slots = torch.randperm(slots_total - 1, device="cuda", generator=gen)[: B * L].view(B, L) + 1
    positions = torch.randint(0, L, (B,), device="cuda", generator=gen)
    positions[:8] = L - 1
    positions[8:16] = 0
    past = torch.arange(L, device="cuda")[None, :] > positions[:, None]
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, slots[past]] = float("nan")
    poisoned_v[:, slots[past]] = float("nan")
    return (q, poisoned_k, poisoned_v, slots, positions), (k, v)


def _errors(out: torch.Tensor, inputs, clean) -> tuple[float, float, float]:
    """Max |kernel - reference|, max |kernel - fp64 truth| and max |truth| (reference and truth read
    the clean pools)."""
    from miles.engine.triton_attention import reference_decode_attention

    q, _, _, slots, positions = inputs
    k, v = clean
    ref = reference_decode_attention(q, k, v, slots, positions, D**-0.5).double()
    truth = reference_decode_attention(q.double(), k.double(), v.double(), slots, positions, D**-0.5)
    out = out.double()
    return (out - ref).abs().max().item(), (out - truth).abs().max().item(), truth.abs().max().item()


@pytest.mark.parametrize("num_splits", [1, None, 5])
def test_fp32_matches_gather_sdpa(num_splits):
    from miles.engine.triton_attention import paged_decode_attention

    inputs, clean = _problem(torch.float32)
    out = paged_decode_attention(*inputs, D**-0.5, num_splits=num_splits)
    assert out.dtype == torch.float32 and out.shape == (B, H, D) and torch.isfinite(out).all()
    err_ref, err_truth, _ = _errors(out, inputs, clean)
    assert err_ref <= 1e-5 and err_truth <= 1e-5, (err_ref, err_truth)


@pytest.mark.parametrize("num_splits", [1, None, 5])
def test_bf16_matches_gather_sdpa(num_splits):
    from miles.engine.triton_attention import paged_decode_attention

    inputs, clean = _problem(torch.bfloat16, seed=1)
    out = paged_decode_attention(*inputs, D**-0.5, num_splits=num_splits)
    assert out.dtype == torch.bfloat16 and out.shape == (B, H, D) and torch.isfinite(out).all()
    err_ref, err_truth, scale = _errors(out, inputs, clean)
    assert err_ref <= 1e-2 * scale, (err_ref, scale)
    # fp32 accumulation and one rounding to nearest: within half a bf16 ulp of the exact answer, plus
    # the TF32 rounding of the probabilities (relative 2^-11 each) in the P.V product
    half_ulp = 2.0 ** (math.frexp(scale)[1] - 9)
    assert err_truth <= half_ulp + 2.0**-10 * scale, (err_truth, half_ulp, scale)


def test_captured_in_cuda_graph_follows_new_inputs():
    """The grid and buffers depend on shapes alone: a captured call replays with fresh inputs."""
    from miles.engine.triton_attention import paged_decode_attention

    inputs, clean = _problem(torch.bfloat16, seed=2)
    static = [t.clone() for t in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_decode_attention(*static, D**-0.5)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*static, D**-0.5)
    for seed in (3, 4):
        new_inputs, new_clean = _problem(torch.bfloat16, seed=seed)
        for dst, src in zip(static, new_inputs, strict=True):
            dst.copy_(src)
        graph.replay()
        eager = paged_decode_attention(*new_inputs, D**-0.5)
        assert torch.equal(out, eager), "graph replay differs from the eager call on the same inputs"
        err_ref, _, scale = _errors(out, new_inputs, new_clean)
        assert err_ref <= 1e-2 * scale, (err_ref, scale)
