"""bench/kernel_registers.py: the LoRA kernels build for sm_90 without a GPU, and cuobjdump's resource
line is read for each (Triton ships both)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")


@pytest.mark.slow
def test_every_kernel_reports_its_registers(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from bench.kernel_registers import rows

    found = rows(arch=90)
    assert {r["kernel"] for r in found} >= {
        "lora_split_silu",
        "lora_split_add_rms_norm_",
        "rope_store_kv with lora",
    }
    assert all(0 < r["registers"] <= 255 and r["stack"] >= 0 for r in found), found
