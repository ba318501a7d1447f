"""The paged decode-attention kernel on CPU, under Triton's interpreter, against the gather + SDPA path.

`@triton.jit` reads TRITON_INTERPRET when it decorates a kernel, i.e. when
miles.engine.triton_attention is first imported, and the setting would leak into every other kernel
of the process; so the cases run in a child interpreter started with TRITON_INTERPRET=1 (this file
run as a script), which prints one JSON line of measured errors per case, and the test asserts on
them. Random shapes: batch, kv heads, group size, head dim (powers of two and not), context length,
padded contexts, positions anywhere below the context length (and -1), one split or several, and a
slot table that is a column slice of a wider one. Slots that only padding positions point at hold
NaN, so a kernel that read a key past the query's position would return NaN.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")

FP32_ATOL = 4e-6  # fp32: sums of a few hundred products of O(1) values, reassociated
BF16_RTOL = 1e-2  # bf16: one rounding of the output (2^-8) plus the reference's own bf16 rounding


def _case(rng, dtype):
    """One random problem: (q, k_pool, v_pool, slots, positions, scale, kernel kwargs), NaN-poisoned."""
    import torch

    B, KVH, G = rng.randint(1, 4), rng.choice([1, 2, 3]), rng.choice([1, 2, 4, 7])
    D, L = rng.choice([16, 24, 32, 64]), rng.randint(1, 150)
    slots_total = B * L + 8
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q = torch.randn(B, KVH * G, D, generator=gen).to(dtype)
    k_pool = torch.randn(KVH, slots_total, D, generator=gen).to(dtype)
    v_pool = torch.randn(KVH, slots_total, D, generator=gen).to(dtype)
    wide = torch.randperm(slots_total - 1, generator=gen)[: B * L].view(B, L) + 1
    table = torch.cat([wide, torch.zeros(B, rng.randint(0, 5), dtype=torch.int64)], dim=1)
    slots = table[:, :L]  # a view whose row stride is the wider table's
    positions = torch.tensor([rng.choice([0, -1, L - 1] + [rng.randrange(L)] * 3) for _ in range(B)])
    clean = (k_pool.clone(), v_pool.clone())
    for b in range(B):  # past the position: point at a NaN slot (padding may point at any slot)
        past = slots[b, max(int(positions[b]), 0) + 1 :]
        k_pool[:, past], v_pool[:, past] = float("nan"), float("nan")
    splits = rng.choice([1, 2, 3, None])
    kwargs = dict(num_splits=splits, block_n=rng.choice([16, 32, 64]))
    return (q, k_pool, v_pool, slots, positions, D**-0.5, kwargs), clean


def run_cases(seed: int, count: int) -> list[dict]:
    """Run `count` random cases per dtype; errors against the gather + SDPA path and an fp64 truth."""
    import random

    import torch

    from miles.engine.triton_attention import paged_decode_attention, reference_decode_attention

    rng, rows = random.Random(seed), []
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(count):
            (q, k, v, slots, pos, scale, kw), (k_clean, v_clean) = _case(rng, dtype)
            out = paged_decode_attention(q, k, v, slots, pos, scale, **kw)
            ref = reference_decode_attention(q, k_clean, v_clean, slots, pos, scale)
            truth = reference_decode_attention(
                q.double(), k_clean.double(), v_clean.double(), slots, pos, scale
            )
            rows.append(
                dict(
                    dtype=str(dtype),
                    shape=[*q.shape, k.shape[0], slots.shape[1]],
                    kwargs=kw,
                    out_dtype=str(out.dtype),
                    out_shape=list(out.shape),
                    finite=bool(torch.isfinite(out).all()),
                    err_ref=float((out.double() - ref.double()).abs().max()),
                    err_truth=float((out.double() - truth).abs().max()),
                    ref_err_truth=float((ref.double() - truth).abs().max()),
                    scale=float(truth.abs().max()),
                )
            )
    return rows


def _check(seed: int, count: int) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, __file__, str(seed), str(count)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * count, proc.stdout[-2000:]
    assert {r["kwargs"]["num_splits"] for r in rows} >= {1, 2}, "the cases must cover one and several splits"
    for r in rows:
        assert r["out_dtype"] == r["dtype"] and r["out_shape"] == r["shape"][:3], r
        assert r["finite"], f"read a key past the query's position (NaN slot): {r}"
        if r["dtype"] == "torch.float32":
            assert r["err_ref"] <= FP32_ATOL, r
        else:
            bound = BF16_RTOL * max(1.0, r["scale"])
            assert r["err_ref"] <= bound and r["err_truth"] <= bound, r
            # fp32 accumulation: no further from the exact answer than the bf16 reference, up to one
            # ulp (the interpreter rounds fp32 -> bf16 toward zero; the GPU rounds to nearest)
            assert r["err_truth"] <= r["ref_err_truth"] + 2.0 ** (math.frexp(r["scale"])[1] - 8), r


def test_kernel_matches_gather_sdpa_under_interpreter():
    _check(seed=0, count=6)


@pytest.mark.slow
def test_kernel_matches_gather_sdpa_many_shapes():
    _check(seed=1, count=24)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(dtype, tmp_path, monkeypatch):
    """The interpreter runs the kernel's Python; this runs Triton's compiler to an sm_90 cubin (with the
    alignment facts the JIT derives at run time), so a construct only the compiler rejects shows."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile every time, cache in the test's dir
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from miles.engine.triton_attention import _combine_kernel, _decode_kernel

    def build(fn, types: dict, consts: dict):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        aligned = [
            n for n in fn.arg_names if n.endswith("_ptr") or n in ("stride_ks", "stride_vs", "stride_sb")
        ]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        return compiler.compile(compiler.ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32))

    for split in (False, True):
        out = "*fp32" if split else f"*{dtype}"
        types = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", slots_ptr="*i64")
        types.update(pos_ptr="*i64", out_ptr=out, lse_ptr=out, scale_log2="fp32")
        consts = dict(G=7, D=64, G_PAD=16, D_PAD=64, BLOCK_N=64, SPLIT=split)
        kernel = build(_decode_kernel, types, dict(consts, PRECISION="ieee" if dtype == "fp32" else "tf32"))
        assert kernel.asm["cubin"], "no cubin"
    combine = dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{dtype}")
    assert build(_combine_kernel, combine, dict(S=4, S_PAD=4, D=64, D_PAD=64)).asm["cubin"]


if __name__ == "__main__":
    for row in run_cases(int(sys.argv[1]), int(sys.argv[2])):
        print(json.dumps(row))
