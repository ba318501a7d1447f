"""The batch-invariant Triton kernels (miles/quant/invariant_triton.py) on the CPU, under Triton's
interpreter (a child interpreter: TRITON_INTERPRET is read when a kernel is decorated, see
tests/unit/interpreted.py), in fp32:

- each kernel against PyTorch's ordinary operations (GEMM, RMSNorm, causal SDPA per sequence,
  log-softmax), and its gradients against theirs;
- invariance: a row's or a query's result computed alone, in a subset, or in another layout (decode
  over a slot pool in random order vs a packed training row) equals the whole batch's bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")


def _linear(torch, kern, gen) -> dict:
    x = torch.randn(150, 40, generator=gen)
    w = torch.randn(70, 40, generator=gen)
    b = torch.randn(70, generator=gen)
    full = kern.linear(x, w, b)
    # the interpreter's tl.dot is NumPy's BLAS, whose result for a row depends on its place in the
    # tile; an MMA's does not (tests/gpu/test_true_on_policy_gpu.py). Here rows keep their place.
    alone = torch.cat([kern.linear(x[:1], w, b), kern.linear(x[128:], w, b)])
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    g = torch.randn(150, 70, generator=gen)
    kern.linear(xg, wg, bg).backward(g)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    torch.nn.functional.linear(*ref).backward(g)
    # two weights stacked by rows, one GEMM (the trainer's q / k / v), against each alone
    w2 = torch.randn(30, 40, generator=gen)
    sg = [t.clone().requires_grad_() for t in (x, w, w2)]
    stacked = kern.stacked_linear(sg[0], sg[1:], torch.cat((b, torch.zeros(30))))
    stacked.backward(torch.cat((g, g[:, :30]), dim=1))
    return {
        "stacked_err": (stacked - torch.cat((full, x @ w2.t()), dim=1)).abs().max().item(),
        "stacked_grad_err": max(
            (sg[0].grad - ref[0].grad - g[:, :30] @ w2).abs().max().item(),
            (sg[1].grad - ref[1].grad).abs().max().item(),
            (sg[2].grad - g[:, :30].t() @ x).abs().max().item(),
        ),  # fmt: skip
        "linear_err": (full - torch.nn.functional.linear(x, w, b)).abs().max().item(),
        "linear_invariant": torch.equal(alone, full[[0, *range(128, 150)]]),
        "linear_grad_err": max(
            (a.grad - r.grad).abs().max().item() for a, r in zip((xg, wg, bg), ref, strict=True)
        ),
    }


def _rms_norm_reference(x, weight, eps: float):
    """transformers' Qwen2RMSNorm / LlamaRMSNorm, PyTorch's ordinary operations."""
    h = x.float()
    h = h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return weight * h.to(x.dtype)


def _rms_norm(torch, kern, gen) -> dict:
    x = torch.randn(33, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    full = kern.rms_norm(x, w, 1e-6)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.randn(33, 96, generator=gen)
    kern.rms_norm(xg, wg, 1e-6).backward(g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    _rms_norm_reference(xr, wr, 1e-6).backward(g)
    bf = x.bfloat16()
    bf_ref = _rms_norm_reference(bf, w.bfloat16(), 1e-6).float()
    return {
        "rms_err": (full - _rms_norm_reference(x, w, 1e-6)).abs().max().item(),
        "rms_invariant": torch.equal(kern.rms_norm(x[5:6], w, 1e-6), full[5:6]),
        "rms_grad_err": max((xg.grad - xr.grad).abs().max().item(), (wg.grad - wr.grad).abs().max().item()),
        "rms_bf16_rel": ((kern.rms_norm(bf, w.bfloat16(), 1e-6).float() - bf_ref).abs() / bf_ref.abs().clamp(min=1e-3)).max().item(),
    }  # fmt: skip


def _attention(torch, kern, gen) -> dict:
    H, KVH, D, lengths = 6, 2, 24, [5, 70, 1, 131]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    T = sum(lengths)
    q = torch.randn(T, H, D, generator=gen)
    k, v = torch.randn(KVH, T, D, generator=gen), torch.randn(KVH, T, D, generator=gen)
    row = kern.PackedRow.of(starts, lengths, "cpu")
    packed = kern.packed_attention(q, k, v, row, D**-0.5)
    ref = kern._causal_reference(q, k, v, row, D**-0.5)
    # the last sequence as a decode engine holds it: its keys at random slots of a larger pool,
    # NaN in every other slot, queries of positions 0, 64, 130 one request each
    a, n = starts[-1], lengths[-1]
    slots = torch.randperm(3 * T, generator=gen)[:n]
    k_pool = torch.full((KVH, 3 * T, D), float("nan"))
    v_pool = k_pool.clone()
    k_pool[:, slots], v_pool[:, slots] = k[:, a : a + n], v[:, a : a + n]
    picks = torch.tensor([0, 64, 130])
    table = torch.cat([slots[None].expand(3, n), torch.zeros(3, 7, dtype=torch.int64)], dim=1)
    decode = kern.paged_attention(q[a + picks], k_pool, v_pool, table, torch.arange(3), picks, D**-0.5)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn(T, H, D, generator=gen)
    kern.packed_attention(qg, kg, vg, row, D**-0.5).backward(g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    kern._causal_reference(qr, kr, vr, row, D**-0.5).backward(g)
    return {
        "attn_err": (packed - ref).abs().max().item(),
        "attn_decode_equal": torch.equal(decode, packed[a + picks]),
        "attn_grad_err": max((x.grad - r.grad).abs().max().item() for x, r in ((qg, qr), (kg, kr), (vg, vr))),
    }


def _logprobs(torch, kern, gen) -> dict:
    z = torch.randn(9, 5000, generator=gen) * 4
    tokens = torch.randint(0, 5000, (9,), generator=gen)
    temps = torch.rand(9, generator=gen) + 0.5
    full = kern.token_logprobs(z, tokens, temps)
    ref = torch.log_softmax(z / temps[:, None], -1).gather(1, tokens[:, None])[:, 0]
    zg, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    g = torch.randn(9, generator=gen)
    kern.token_logprobs(zg, tokens, temps).backward(g)
    (torch.log_softmax(zr / temps[:, None], -1).gather(1, tokens[:, None])[:, 0] * g).sum().backward()
    # rows 7, 2, 4 picked inside the kernels: their values, and a gradient only on those rows
    rows = torch.tensor([7, 2, 4])
    zp = z.clone().requires_grad_()
    picked = kern.token_logprobs(zp, tokens[rows], temps[rows], rows=rows)
    picked.backward(g[rows])
    want_grad = torch.zeros_like(z)
    want_grad[rows] = zg.grad[rows]
    return {
        "logprob_err": (full - ref).abs().max().item(),
        "logprob_invariant": torch.equal(kern.token_logprobs(z[3:5], tokens[3:5], temps[3:5]), full[3:5]),
        "logprob_scalar_t": (kern.token_logprobs(z, tokens, 0.7)
                             - torch.log_softmax(z / 0.7, -1).gather(1, tokens[:, None])[:, 0]).abs().max().item(),
        "logprob_grad_err": (zg.grad - zr.grad).abs().max().item(),
        "logprob_rows_equal": torch.equal(picked, full[rows]),
        "logprob_rows_grad_err": (zp.grad - want_grad).abs().max().item(),
    }  # fmt: skip


def main() -> None:
    import torch

    from miles.quant import invariant_triton as kern

    gen = torch.Generator().manual_seed(0)
    for part in (_linear, _rms_norm, _attention, _logprobs):
        print(json.dumps(part(torch, kern, gen)))


@pytest.fixture(scope="module")
def measured() -> dict:
    from interpreted import run_cases

    return run_cases(os.path.abspath(__file__))


def test_each_kernel_equals_pytorch_within_fp32_rounding(measured) -> None:
    for key in ("linear_err", "stacked_err", "rms_err", "attn_err", "logprob_err", "logprob_scalar_t"):
        assert measured[key] < 2e-5, (key, measured[key])
    assert measured["rms_bf16_rel"] <= 2**-5, measured  # two bf16 roundings (normalised, times w)


def test_each_kernel_gives_a_row_the_same_bits_in_any_batch(measured) -> None:
    keys = (
        "linear_invariant",
        "rms_invariant",
        "attn_decode_equal",
        "logprob_invariant",
        "logprob_rows_equal",
    )
    for key in keys:
        assert measured[key] is True, key


def test_gradients_are_pytorchs(measured) -> None:
    for key in (
        "linear_grad_err",
        "rms_grad_err",
        "attn_grad_err",
        "logprob_grad_err",
        "logprob_rows_grad_err",
    ):
        assert measured[key] < 5e-5, (key, measured[key])


def test_a_forwards_sequences_are_read_once_and_follow_changes() -> None:
    import torch

    from miles.train.fsdp import true_on_policy as top

    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert top._packed_rows(pos, False) == [([0, 3, 5], [3, 2, 1])]
    assert top._packed_rows(pos, False) is top._packed_rows(pos, False)  # every layer: no host read
    (row,) = top._packed_rows(pos, True)  # the kernels' form: on the device, one copy
    assert top._packed_rows(pos, True)[0] is row
    assert row.table.tolist() == [[0, 1, 2], [3, 4, 5], [5, 6, 7]]
    assert (row.req.tolist(), row.pos.tolist()) == ([0, 0, 0, 1, 1, 2], [0, 1, 2, 0, 1, 0])
    assert (row.bounds.tolist(), row.bounds.dtype) == ([0, 3, 5, 6], torch.int32)
    pos[0, 4] = 0  # changed in place: read again
    assert top._packed_rows(pos, False) == [([0, 3, 4, 5], [3, 1, 1, 1])]
    assert top._packed_rows(torch.tensor([[0, 1, 2, 3, 4, 5]]), False) == [([0], [6])]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()


def test_the_trainer_multiplies_q_k_v_and_gate_up_as_one_gemm_each(tmp_path, monkeypatch) -> None:
    """As the engine's invariant forward multiplies its fused qkv_proj / gate_up_proj: one stacked GEMM
    per group in a forward, the members' gradients those of separate projections."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import init_tiny
    from miles.quant import invariant
    from miles.train.fsdp import true_on_policy as top

    model = init_tiny(tmp_path / "m", arch="qwen2", seed=0)
    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    top.install(net)
    calls = []
    stacked = invariant.stacked_linear
    monkeypatch.setattr(
        invariant, "stacked_linear", lambda x, w, b, sizes: calls.append(len(w)) or stacked(x, w, b, sizes)
    )
    ids = torch.randint(3, 200, (1, 12))
    pos = torch.arange(12)[None]
    for m in (net, plain):
        m(input_ids=ids, position_ids=pos, use_cache=False).logits.float().square().mean().backward()
    layers = net.config.num_hidden_layers
    assert sorted(calls) == [2] * layers + [3] * layers, calls
    first = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.v_proj.bias", "mlp.up_proj.weight"):
        got, want = net.get_parameter(first + name).grad, plain.get_parameter(first + name).grad
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-6), (name, (got - want).abs().max())
