"""The DeepSeek-V4 Flash launcher's Megatron miniature on one GPU: `launchers/deepseek_v4_flash.py train
--scale tiny --backend megatron` lays out PP1 EP1 beside the engine (colocated) and trains the tiny
DeepSeek-V4 with the registered DeepSeek-V4 modules in bf16: R3 routes every trained token through the
rollout's experts, TIS and the engine/trainer |delta log p| are logged each step, the evaluations run
and the last step's checkpoint is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core is CUDA-only)"),
]
SCRIPT = str(Path(__file__).parents[2] / "launchers" / "deepseek_v4_flash.py")


def test_tiny_megatron_trains_on_one_gpu(tmp_path: Path) -> None:
    sets = ("--set", "eval.every_steps=3")
    out = subprocess.run([sys.executable, SCRIPT, "train", "--scale", "tiny", "--backend", "megatron", "--gpus", "1",
                          "--tiny-dir", str(tmp_path), *sets], capture_output=True, text=True, timeout=500)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run = tmp_path / "runs" / "deepseek-v4-flash-tiny-megatron"
    steps = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2, 3):
        m = steps[step]
        print(step, {k: v for k, v in m.items() if k.startswith("train/") and "expert_load" not in k})
        assert m["train/router_agreement"] == 1.0, f"step {step}: R3 must train on the rollout's experts"
        assert {"train/tis_weight_mean", "train/logprob_mismatch"} <= set(m), sorted(m)
        assert m["train/logprob_mismatch"] < 0.1, "bf16: the engine and the trainer compute the same model"
    assert "eval/aime/pass@1" in steps[3]
    assert (run / "checkpoints" / "step_3" / ".complete").is_file()
