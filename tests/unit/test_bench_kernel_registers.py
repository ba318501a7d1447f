"""bench/kernel_registers.py: the LoRA and MoE kernels build for sm_90 without a GPU, and cuobjdump's resource
line is read for each (Triton ships both)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")


@pytest.mark.slow
def test_every_kernel_reports_its_registers(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from bench.kernel_registers import moe_rows, rows

    found = rows(arch=90) + moe_rows(arch=90)
    assert {r["kernel"] for r in found} >= {
        "lora_split / lora_add_ (expand)",
        "lora_split_silu",
        "rope_store_kv with lora",
    }
    assert all(0 < r["registers"] <= 255 and r["stack"] >= 0 for r in found), found


@pytest.mark.slow
def test_the_moe_gemm_builds_for_shapes_the_tiles_do_not_divide(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from bench.kernel_registers import resources
    from miles.engine import triton_moe as moe

    cfg = moe.tiles(16)
    types = dict(a_ptr="*bf16", w_ptr="*bf16", c_ptr="*bf16", rows_ptr="*i32", block_expert_ptr="*i32",
                 used_ptr="*i32")  # fmt: skip
    consts = dict(A_DIV=8, PRECISION="tf32", BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], EVEN=False)
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    assert resources(moe._expert_gemm_kernel, types, consts, options, 90)["registers"] > 0
