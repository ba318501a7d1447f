"""A black-box agent end to end: `miles train` of the default task with `miles.agentic.program:program_agent`
running examples/agents/delegating_agent.py, a separate program that knows only its OpenAI base_url,
delegates each task to a sub-agent session and compacts its own context. Its first attempt, its
compacted history (a fork of its session) and the sub-agent's conversation reach the trainer as one
episode (three branches of weight 1/3 each) and the steps train."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from conftest import deep_update, finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_an_external_program_with_a_sub_agent_trains(tmp_path, tiny_model) -> None:
    agent = REPO / "examples" / "agents" / "delegating_agent.py"
    data = deep_update(
        yaml.safe_load((REPO / "recipes" / "default.yaml").read_text()),
        {
            "run": {"name": "blackbox", "runs_root": str(tmp_path / "runs"), "tensorboard": False},
            "model": {"path": tiny_model, "init_tiny_if_missing": False},
            "rollout": {
                "agent_fn": "miles.agentic.program:program_agent",
                "agent_options": {"command": f"{sys.executable} {agent}", "timeout_s": 60},
                "prompts_per_step": 4,
                "n_samples_per_prompt": 2,
                "buffer_capacity_groups": 4,
            },
            "eval": {"every_steps": 0},
            "train": {"steps": 2, "checkpoint": {"every_steps": 0}},
        },
    )
    path = tmp_path / "blackbox.yaml"
    path.write_text(yaml.safe_dump(data))
    finish(miles_train(str(path)), timeout_s=500)
    steps = [r for r in read_metrics(tmp_path / "runs" / "blackbox") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # every episode: the program's first attempt, its compacted history and its sub-agent's call
        assert r["agent/branches"] == 3 and r["agent/turns"] >= 1
        assert r["rollout/batch_samples"] == 3 * 4 * 2
        assert r["train/tokens"] >= r["rollout/batch_samples"] and r["train/grad_norm"] > 0
