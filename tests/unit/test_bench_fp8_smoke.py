"""bench/fp8_gpu.py --smoke: the FP8 benchmark runs end to end on the CPU (tiny model, 2 rounds, 2 GRPO
steps, all three parts) and prints every row of its table: 5 engine arms x 2 workloads, the train arms
(torchao_float8 skipped with its reason), the 3 mismatch runs and their per-step values."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARMS = ("bf16", "fp8_block @ 1024", "fp8_block @ 1", "fp8_row @ 1024", "fp8_row @ 1")


def test_smoke_run_prints_every_row(tmp_path):
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, "-m", "bench.fp8_gpu", "--smoke", "--workdir", str(tmp_path), "--out", str(out)]
    # the mismatch runs' children import the recipe's reward (bench.e2e_gpu) from the repository root
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("### FP8 vs bf16 on one GPU") :]
    print(table)

    assert "    python -m bench.fp8_gpu --smoke --workdir" in table
    assert f"torch {torch.__version__}" in table and re.search(r"\(\d{4}-\d\d-\d\d \d\d:\d\d - ", table)
    for definition in ("- rollout tok/s:", "- rollout speed-up =", "train speed-up =", "- mismatch ="):
        assert definition in table
    for workload in ("decode", "prefill"):
        for arm in ENGINE_ARMS:
            row = rf"^\| tiny \(smoke\) \| {workload} \| {re.escape(arm)} \| \d[\d.k-]* \| [\d.x-]+ \| \w"
            assert re.search(row, table, re.M), (workload, arm)
    assert re.search(r"^\| none \| [\d.-]+ \| 1 \| reference \|$", table, re.M)
    assert re.search(r"^\| fake_quant \| [\d.-]+ \| [\d.x-]+ \| \w", table, re.M)
    assert "| torchao_float8 | skipped: train.quantization=torchao_float8 runs on CUDA only" in table
    for label in ("bf16 engine, bf16 trainer", "fp8_block engine, trainer without the contract",
                  "fp8_block engine, trainer with the contract"):  # fmt: skip
        assert re.search(rf"^\| {label} \| `engine.quantization=[^|]+ \| \d\.\d+e[-+]\d+ \|", table, re.M), (
            label
        )
    assert re.search(r"^\| 1 \| [-+.e\d]+ \| [-+.e\d]+ \| [-+.e\d]+ \|$", table, re.M)
    assert re.search(r"^\| 2 \| [-+.e\d]+ \| [-+.e\d]+ \| [-+.e\d]+ \|$", table, re.M)
    assert "With the contract the FP8 mismatch is lower than without it" in table

    data = json.loads(out.read_text())
    assert len(data["rollout"]) == 10 and all(len(r["tok_s"]) == 2 for r in data["rollout"])
    assert [r["quantization"] for r in data["train"]] == ["none", "fake_quant", "torchao_float8"]
    bf16, without, with_contract = data["mismatch"]
    assert all(len(r["mismatch"]) == 2 and r["rc"] == 0 for r in data["mismatch"])
    assert bf16["checksum_mismatch"] == []  # no weights.check on the bf16 run
    assert without["checksum_mismatch"] == [0.0, 0.0] and with_contract["checksum_mismatch"] == [0.0, 0.0]
