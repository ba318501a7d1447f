"""The whole RL loop on GPU(s): `miles train` with the embedded engine and the FSDP trainer on CUDA.

colocated: engine and trainer share GPU 0; the engine releases its memory around every training step
and the weights travel as CUDA IPC handles. disaggregated (2 GPUs): engine on GPU 0, trainer on GPU 1,
fully async, weights broadcast over NCCL. Both must learn (reward rises) and serve exactly the
trainer's weights after every push. Skipped without CUDA (disaggregated: without 2 GPUs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from miles.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E2E = Path(__file__).resolve().parents[1] / "e2e"  # e2e_rewards.has_digit, a reward a tiny model learns fast


def run(tmp_path: Path, tiny_model: str, layout: str, steps: int) -> list[dict]:
    colocated = layout == "colocated"
    recipe = {
        "run": {"name": layout, "runs_root": str(tmp_path), "seed": 0, "tensorboard": False},
        "model": {"path": tiny_model, "dtype": "bfloat16"},
        "engine": {"device": "cuda", "max_running_requests": 64},
        "rollout": {
            "task": {"name": "digits", "options": {"op": "last", "num_digits": 1}, "eval_size": 2},
            "reward": "e2e_rewards:has_digit",
            "prompts_per_step": 8,
            "n_samples_per_prompt": 8,
            "max_new_tokens": 3,
            "schedule": "sync" if colocated else "async",
        },
        "eval": {"every_steps": 0},
        "train": {"device": "cuda", "steps": steps, "lr": 3e-3, "max_tokens_per_microbatch": 512},
        "weights": {"check": True, "pause_mode": "in_place"},
        "launch": {"layout": layout},
    }
    path = tmp_path / f"{layout}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "miles.cli", "train", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return [r for r in read_metrics(tmp_path / layout) if r["step"] > 0]


def check_learns(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["weights/check_max_diff"] == 0.0 for r in records)
    rewards = [r["rollout/reward_mean"] for r in records]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.2, rewards
    # bf16 engine vs bf16 trainer on the same tokens: the mismatch stays small
    assert max(r["train/logprob_mismatch"] for r in records) < 0.05, [
        r["train/logprob_mismatch"] for r in records
    ]


def test_colocated_run_learns(tmp_path, tiny_model) -> None:
    records = run(tmp_path, tiny_model, "colocated", steps=30)
    check_learns(records, 30)
    assert all(r["time/engine_release_s"] > 0 for r in records)
    assert "transport: tensor" in (tmp_path / "colocated" / "plan.yaml").read_text()


@pytest.mark.gpu2  # the engine on one, the trainer on the other
def test_disaggregated_run_learns_over_nccl(tmp_path, tiny_model) -> None:
    records = run(tmp_path, tiny_model, "disaggregated", steps=30)
    check_learns(records, 30)
    assert "transport: distributed" in (tmp_path / "disaggregated" / "plan.yaml").read_text()
