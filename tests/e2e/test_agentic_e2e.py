"""End to end: a few steps of recipes/agentic-tiny.yaml through `miles train` (real engine, trainer,
weight sync): multi-turn episodes with mixed loss masks reach the trainer, and the per-episode
agent metrics land in metrics.jsonl, TensorBoard and the progress bar. Not the learning run (that
one is measured in bench/RESULTS.md). The same episodes at the agent level: an agent function that
plays them with the `openai` client against its session `base_url`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "agentic-tiny.yaml"
AGENT_KEYS = ("turns", "tool_calls", "tool_errors", "success", "env_time_s", "generate_time_s", "branches")


def _recipe(tmp_path: Path, tiny_model: str, **rollout: Any) -> tuple[Path, Path]:
    data = yaml.safe_load(RECIPE.read_text())
    data["run"].update(name="agentic-e2e", runs_root=str(tmp_path / "runs"), tensorboard=True)
    data["model"] = {"path": tiny_model, "init_tiny_if_missing": False}
    data["rollout"].update(prompts_per_step=4, n_samples_per_prompt=4, buffer_capacity_groups=4)
    data["rollout"]["task"]["eval_size"] = 4
    data["eval"] = {"every_steps": 2, "samples_per_prompt": 2, "temperature": 0.6}
    data["train"].update(steps=3, checkpoint={"every_steps": 0})
    data["rollout"].update(rollout)
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, tmp_path / "runs" / "agentic-e2e"


def test_agentic_recipe_runs_multi_turn_episodes(tmp_path: Path, tiny_model: str) -> None:
    path, run_dir = _recipe(tmp_path, tiny_model)
    out = finish(miles_train(str(path)), timeout_s=500)

    records = read_metrics(run_dir)
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for key in AGENT_KEYS:
            assert f"agent/{key}" in r, (key, sorted(r))
        # every episode has at least two one-token turns (a call, then an answer or a second call)
        # and an observation between them: the trainer got both mask values
        samples = r["rollout/batch_samples"]
        assert samples == 16
        response_tokens = r["rollout/response_len_mean"] * samples
        assert 2 * samples <= r["train/tokens"] < response_tokens
        assert r["agent/turns"] >= 2 and r["agent/tool_calls"] >= 1 and r["agent/branches"] == 1
        assert 0.0 <= r["agent/success"] <= 1.0 and r["agent/generate_time_s"] > 0
    evals = {r["step"]: r["eval/pass@1"] for r in records if "eval/pass@1" in r}
    assert set(evals) >= {0, 2}
    events = list((run_dir / "tensorboard").glob("events.*"))
    assert events and any(b"agent/turns" in e.read_bytes() for e in events)
    assert "turns=" in out and "success=" in out  # the progress bar shows the episode means


async def lookup_agent(task: dict[str, Any], base_url: str) -> dict[str, float]:
    """A `lookup` episode through an OpenAI client: a call turn, the tool's answer, an answer turn."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"value {task['key']}"}]
    call = (await client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)).choices[0]
    key = re.search(r"\d", call.message.content or "")
    observation = str(task["table"][int(key.group(0))]) if key else "error"
    messages += [
        {"role": "assistant", "content": call.message.content or ""},
        {"role": "tool", "content": observation, "tool_call_id": "call_0"},
    ]
    reply = (await client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)).choices[0]
    success = (reply.message.content or "").strip()[:1] == str(task["table"][task["key"]])
    return {"reward": float(success), "tool_calls": 1.0, "tool_errors": float(key is None)}


def test_agent_function_through_the_session_server(tmp_path: Path, tiny_model: str) -> None:
    path, run_dir = _recipe(tmp_path, tiny_model, generate_fn=None, agent_fn="test_agentic_e2e:lookup_agent")
    finish(miles_train(str(path)), timeout_s=500)
    steps = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # two chat calls per episode, each one recorded token: the session server's samples trained
        # with mask 1 on the replies and mask 0 on the templated tool turn between them
        assert r["agent/turns"] == 2 and r["agent/tool_calls"] == 1
        assert r["rollout/batch_samples"] >= 16 and r["agent/branches"] >= 1
        n = r["rollout/batch_samples"]
        assert 2 * n <= r["train/tokens"] < r["rollout/response_len_mean"] * n
