"""The fused kernels of miles/engine/triton_fused.py on CPU, under Triton's interpreter, against the
per-op PyTorch path they replace; and the decoder's fused forward against its per-op forward.

As in test_triton_attention.py, TRITON_INTERPRET is read when a kernel is decorated and would leak
into every other kernel of the process, so the cases run in a child interpreter started with
TRITON_INTERPRET=1 (this file run as a script) that prints one JSON line of measured errors per case;
the tests assert on them. Shapes are small and awkward: head counts and half head dims that are not
powers of two, an MLP width the block does not divide, strided rows, a pool whose other slots hold
NaN (a stray write shows as a changed slot).

The interpreter rounds fp32 to bf16 toward zero where the GPU (and PyTorch) round to nearest even,
so the references compute the per-op path's fp32 values and round them toward zero at the same
points: equal bits then mean that every rounding saw the same fp32 value as the per-op path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")

EPS = 1e-6


def _round(x, dtype):
    """fp32 x rounded to dtype as the interpreter rounds: toward zero (bf16: the high 16 bits)."""
    import torch

    if dtype == torch.float32:
        return x
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)


def _ulps(out, ref) -> float:
    """Largest difference in units of the last place of ref's dtype (bf16: 2^-7 relative)."""
    import torch

    bits = {torch.bfloat16: 8, torch.float32: 24}[ref.dtype]
    exp = torch.frexp(ref.double().abs().clamp(min=1e-30))[1]
    return float(((out.double() - ref.double()).abs() / 2.0 ** (exp - bits)).max())


def _diff(out, ref) -> dict:
    import torch

    return dict(
        shape_ok=out.shape == ref.shape and out.dtype == ref.dtype,
        finite=bool(torch.isfinite(out).all()),
        ulps=_ulps(out, ref),
        rel=float((out.double() - ref.double()).abs().max() / ref.double().abs().max()),
        equal=float((out == ref).float().mean()),
    )


def norm_cases() -> list[dict]:
    import torch
    import torch.nn.functional as F

    from miles.engine.triton_fused import add_rms_norm_

    rows, gen = [], torch.Generator().manual_seed(0)
    for N, dtype, with_delta in [
        (96, torch.bfloat16, True),
        (96, torch.bfloat16, False),
        (40, torch.float32, True),
    ]:
        wide = torch.randn(7, N + 5, generator=gen) * 3
        x, pad = wide[:, :N], wide[:, N:].clone()  # strided rows
        delta = torch.randn(7, N, generator=gen).to(dtype) if with_delta else None
        w = (1 + 0.3 * torch.randn(N, generator=gen)).to(dtype)
        x_ref = x + delta if with_delta else x.clone()  # bf16 delta promoted: one fp32 add
        y_ref = _round(w * F.rms_norm(x_ref, (N,), eps=EPS), dtype)  # Decoder._norm(x).to(dtype)
        y = add_rms_norm_(x, delta, w, EPS, dtype)
        rows.append(dict(kernel="add_rms_norm", N=N, dtype=str(dtype), delta=with_delta, **_diff(y, y_ref)))
        rows[-1]["x_exact"] = bool(torch.equal(x, x_ref))
        rows[-1]["pad_untouched"] = bool(torch.equal(wide[:, N:], pad))
    return rows


def rope_cases() -> list[dict]:
    import torch
    import torch.nn.functional as F

    from miles.engine.model import Decoder
    from miles.engine.triton_fused import rope_store_kv

    rows, gen = [], torch.Generator().manual_seed(1)
    for H, KVH, D, dtype, qk_norm in [
        (6, 2, 24, torch.bfloat16, False),
        (6, 2, 24, torch.bfloat16, True),
        (4, 4, 16, torch.float32, False),
        (3, 1, 32, torch.bfloat16, True),
    ]:
        T, slots_total = 5, 12
        wide = torch.randn(T, (H + 2 * KVH) * D + 3, generator=gen).to(dtype)
        qkv = wide[:, 3:]  # strided rows
        pos = torch.tensor([0, 3, 17, 250, 4000])
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D).float()
        freqs = pos.float()[:, None] * inv_freq[None, :]
        slots = torch.randperm(slots_total, generator=gen)[:T]
        k_pool = torch.full((KVH, slots_total, D), float("nan"), dtype=dtype)
        v_pool = torch.full((KVH, slots_total, D), float("nan"), dtype=dtype)
        norms = (
            [(1 + 0.3 * torch.randn(D, generator=gen)).to(dtype) for _ in range(2)] if qk_norm else [None] * 2
        )
        q = rope_store_kv(qkv, freqs.cos(), freqs.sin(), k_pool, v_pool, slots, H, *norms, eps=EPS)
        # the per-op path: Decoder._qkv's split, per-head norms and _rope over [cos | cos]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        q_ref, k_ref, v_ref = qkv.split([H * D, KVH * D, KVH * D], dim=1)
        q_ref, k_ref, v_ref = q_ref.view(T, H, D), k_ref.view(T, KVH, D), v_ref.view(T, KVH, D)
        if qk_norm:  # Decoder._norm of bf16: rms_norm rounds once, the weight's product again
            q_ref = _round(norms[0] * _round(F.rms_norm(q_ref.float(), (D,), eps=EPS), dtype).float(), dtype)
            k_ref = _round(norms[1] * _round(F.rms_norm(k_ref.float(), (D,), eps=EPS), dtype).float(), dtype)
        # Decoder._rope's fp32 value: its final .to(dtype) is a no-op on fp32, then _round
        q_ref, k_ref = (
            _round(Decoder._rope(None, t.float(), emb.cos(), emb.sin()), dtype) for t in (q_ref, k_ref)
        )
        others = torch.ones(slots_total, dtype=torch.bool)
        others[slots] = False
        row = dict(kernel="rope_store_kv", H=H, KVH=KVH, D=D, dtype=str(dtype), qk_norm=qk_norm)
        rows.append(dict(row, part="q", **_diff(q, q_ref)))
        rows.append(dict(row, part="k", **_diff(k_pool[:, slots].transpose(0, 1), k_ref)))
        rows.append(dict(row, part="v", **_diff(v_pool[:, slots].transpose(0, 1), v_ref)))
        rows[-1]["others_untouched"] = bool(
            k_pool[:, others].isnan().all() and v_pool[:, others].isnan().all()
        )
    return rows


def silu_cases() -> list[dict]:
    import torch
    import torch.nn.functional as F

    from miles.engine.triton_fused import silu_mul

    rows, gen = [], torch.Generator().manual_seed(2)
    for inter, block, dtype in [
        (100, 32, torch.bfloat16),
        (100, 128, torch.bfloat16),
        (72, 16, torch.float32),
    ]:
        wide = (torch.randn(4, 2 * inter + 6, generator=gen) * 4).to(dtype)
        wide[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-3, -1e-3]).to(dtype)
        gu = wide[:, 6:]  # strided rows
        gate, up = gu[:, :inter].float(), gu[:, inter:].float()
        ref = _round(_round(F.silu(gate), dtype).float() * up, dtype)  # F.silu(gate) * up in dtype
        out = silu_mul(gu, block=block)
        rows.append(dict(kernel="silu_mul", inter=inter, block=block, dtype=str(dtype), **_diff(out, ref)))
    return rows


def forward_cases() -> list[dict]:
    """Decoder.fused_forward.forward against Decoder.forward's per-op path (fp32: only the norms' sums of
    squares are ordered differently), on a prefill of two requests and then a decode step."""
    import torch

    from miles.engine.model import Batch, Decoder, ModelSpec

    rows = []
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"):
        spec = ModelSpec(arch, 50, 40, 2, 6, 2, 12, 10000.0, EPS, arch == "LlamaForCausalLM", 512, (1,))
        gen = torch.Generator().manual_seed(3)
        shapes = _weight_shapes(spec, inter=56)
        weights = {n: torch.randn(s, generator=gen) * (0.2 if len(s) > 1 else 1.0) for n, s in shapes.items()}
        weights.update({n: 1 + 0.2 * torch.randn(s, generator=gen) for n, s in shapes.items() if "norm" in n})
        dec = Decoder(spec, weights, "cpu", torch.float32)
        out = {}
        for fused in (False, True):
            pool = dec.new_kv_pool(16)
            prefill = Batch(
                input_ids=torch.tensor([5, 6, 7, 8, 9]), positions=torch.tensor([0, 1, 2, 0, 1]),
                write_slots=torch.tensor([1, 2, 3, 4, 5]), query_index=torch.tensor([[0, 1, 2], [3, 4, 0]]),
                query_pos=torch.tensor([[0, 1, 2], [0, 1, -1]]),
                context_slots=torch.tensor([[1, 2, 3], [4, 5, 0]]), last_index=torch.tensor([2, 4]),
            )  # fmt: skip
            table = torch.tensor([[1, 2, 3, 6], [4, 5, 7, 0]])
            decode = Batch.decode(
                torch.tensor([11, 12]), torch.tensor([3, 2]), torch.tensor([0, 1]), table, 4
            )
            run = dec.fused_forward.forward if fused else dec.forward
            out[fused] = (
                run(prefill, pool),
                run(decode, pool),
                torch.stack([torch.stack(kv) for kv in pool]),
            )
        for name, a, b in zip(("prefill", "decode", "kv_pool"), out[True], out[False], strict=True):
            err = float((a - b).abs().max())
            rows.append(dict(kernel="forward", arch=arch, part=name, err=err, scale=float(b.abs().max())))
    return rows


def _weight_shapes(spec, inter: int) -> dict[str, tuple[int, ...]]:
    from miles.engine.model import Decoder

    hid, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    ends = {
        "embed_tokens.weight": (spec.vocab_size, hid), "lm_head.weight": (spec.vocab_size, hid),
        "q_norm.weight": (spec.head_dim,), "k_norm.weight": (spec.head_dim,), "norm.weight": (hid,),
        "q_proj.weight": (q, hid), "k_proj.weight": (kv, hid),
        "v_proj.weight": (kv, hid), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "o_proj.weight": (hid, q), "gate_proj.weight": (inter, hid), "up_proj.weight": (inter, hid),
        "down_proj.weight": (hid, inter),
    }  # fmt: skip
    names = Decoder.expected_names(type("S", (), {"spec": spec})())
    return {n: next(s for e, s in ends.items() if n.endswith(e)) for n in names}


def _child_rows() -> list[dict]:
    proc = subprocess.run(
        [sys.executable, __file__],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in _child_rows():
        out.setdefault(r["kernel"], []).append(r)
    return out


def test_add_rms_norm(rows):
    assert len(rows["add_rms_norm"]) == 3
    for r in rows["add_rms_norm"]:
        assert r["shape_ok"] and r["finite"] and r["x_exact"] and r["pad_untouched"], r
        # the sum of squares is ordered differently: fp32 ulps, so a rare rounding to bf16 flips
        if r["dtype"] == "torch.bfloat16":
            assert r["ulps"] <= 1.0 and r["equal"] >= 0.97, r
        else:
            assert r["ulps"] <= 8.0, r


def test_rope_store_kv(rows):
    assert len(rows["rope_store_kv"]) == 12
    for r in rows["rope_store_kv"]:
        assert r["shape_ok"] and r["finite"] and r.get("others_untouched", True), r
        if r["qk_norm"] and r["part"] != "v":
            # the norm's sum of squares: a rare one-ulp flip of a normed value before RoPE
            assert r["rel"] <= 2.0**-7 and r["equal"] >= 0.95, r
        else:  # the same fp32 products and sums, one rounding: bit-identical
            assert r["equal"] == 1.0, r


def test_silu_mul(rows):
    assert len(rows["silu_mul"]) == 3
    for r in rows["silu_mul"]:
        # exp is numpy's here and PyTorch's own on CPU (on the GPU both are libdevice's expf): ulps
        # apart in fp32, so a rare rounding to bf16 may flip
        assert r["shape_ok"] and r["finite"] and r["ulps"] <= 4.0, r
        assert r["equal"] >= (0.99 if r["dtype"] == "torch.bfloat16" else 0.5), r


def test_fused_forward_matches_per_op_forward(rows):
    assert len(rows["forward"]) == 9
    for r in rows["forward"]:
        assert r["err"] <= 2e-5 * max(1.0, r["scale"]), r


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """The interpreter runs the kernels' Python; this runs Triton's compiler to sm_90 cubins with the
    launch options of the wrappers (no FMA contraction; libdevice's exp), so a construct only the
    compiler rejects shows."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from miles.engine.triton_fused import _add_rms_norm_kernel, _rope_store_kernel, _silu_mul_kernel

    def build(fn, types: dict, consts: dict):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {
            (fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n.endswith("_ptr")
        }
        src = compiler.ASTSource(fn, sig, consts, attrs)
        kernel = compiler.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(enable_fp_fusion=False))
        assert kernel.asm["cubin"], "no cubin"

    for has_delta in (False, True):
        types = dict(x_ptr="*fp32", delta_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", eps="fp32")
        build(_add_rms_norm_kernel, types, dict(BLOCK=1024, HAS_DELTA=has_delta))
    for qk_norm in (False, True):
        for lora in (False, True):  # with a q/k/v LoRA group's term (miles/engine/triton_lora.py)
            names = ("qkv_ptr", "q_ptr", "k_pool_ptr", "v_pool_ptr", "qn_ptr", "kn_ptr", "h_ptr", "b_ptr")
            types = {n: "*bf16" for n in names}
            types.update(cos_ptr="*fp32", sin_ptr="*fp32", slots_ptr="*i64", stride_ps="i64", eps="fp32")
            types.update(lora_slot_ptr="*i64", scale_ptr="*fp32")
            consts = dict(H=14, KVH=2, D=64, H_PAD=16, KVH_PAD=2, HALF_PAD=32, QK_NORM=qk_norm, LORA=lora)
            consts.update(R=16, SR=128, JB=8) if lora else consts.update(R=1, SR=1, JB=1)
            build(_rope_store_kernel, types, consts)
    build(_silu_mul_kernel, dict(gu_ptr="*bf16", out_ptr="*bf16"), dict(BLOCK=1024, LIBDEVICE=True))


if __name__ == "__main__":
    for row in norm_cases() + rope_cases() + silu_cases() + forward_cases():
        print(json.dumps(row))
