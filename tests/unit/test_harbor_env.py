"""The `harbor` environment in real bubblewrap sandboxes, played with scripted assistant turns: tool
calls in the compact and JSON forms act in /app, the verifier's reward ends the episode, an episode
without a tool call is graded by the tests, a failed verifier masks the episode, and the options are
checked."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from miles.agentic.envs.base import make_env
from miles.rollout.tasks import EVAL_OFFSET

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
SHIPPED = Path(__file__).resolve().parents[2] / "tasks"


def _solve_generated(instruction: str) -> str:
    """The right first turn for a generated task: a compact call, or the JSON form for the edit."""
    m = re.match(r"Create the file (\S+) in /app containing (\S+)\.", instruction)
    if m:
        return f"<tool_call>bash echo {m.group(2)} > {m.group(1)}</tool_call>"
    m = re.match(r"Change the mode in /app/settings.txt to (\S+)\.", instruction)
    assert m, instruction
    call = {"name": "bash", "arguments": {"command": f"sed -i s/^mode=.*/mode={m.group(1)}/ settings.txt"}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def test_generated_tasks_scored_by_their_tests() -> None:
    env = make_env("harbor", generate=True, max_turns=4)

    async def episode(index: int, solve: bool):
        obs = await env.reset(env.make_task(3, index))
        assert obs.messages[0]["role"] == "system" and "sandbox_start_s" in obs.info
        steps = []
        if solve:
            steps.append(await env.step(_solve_generated(obs.messages[-1]["content"])))
        steps.append(await env.step("<tool_call>submit done</tool_call>"))
        await env.close()
        return steps

    for index in (0, 1, 2, EVAL_OFFSET):
        solved = asyncio.run(episode(index, True))
        assert not solved[0].done and solved[0].messages[0]["content"].endswith("[exit code 0]")
        assert solved[-1].done and solved[-1].reward == 1.0 and solved[-1].info["success"]
        assert solved[-1].info["verifier_s"] > 0 and "masked" not in solved[-1].info
        idle = asyncio.run(episode(index, False))
        assert idle[-1].done and idle[-1].reward == 0.0
    assert env.make_task(3, 5) == env.make_task(3, 5) and env.make_task(3, 5) != env.make_task(
        3, EVAL_OFFSET + 5
    )


def test_a_dataset_episode_with_file_tools_and_a_final_answer() -> None:
    env = make_env("harbor", tasks=str(SHIPPED), eval_tasks=str(SHIPPED / "repair-config"), max_turns=5)
    names = [Path(env.make_task(0, i)["path"]).name for i in range(4)]
    assert sorted(names) == ["fix-median", "git-commit", "greet-script", "repair-config"]
    assert Path(env.make_task(0, EVAL_OFFSET + 2)["path"]).name == "repair-config"
    config = {"name": "inventory", "port": 8080, "debug": False, "workers": 4, "paths": ["/data", "/cache"]}
    write = {"name": "write_file", "arguments": {"path": "config.json", "content": json.dumps(config)}}

    async def go():
        await env.reset(env.make_task(0, EVAL_OFFSET))
        read = await env.step("<tool_call>read_file config.json</tool_call>")
        missing = await env.step("<tool_call>read_file nope.json</tool_call>")
        wrote = await env.step(f"<tool_call>{json.dumps(write)}</tool_call>")
        final = await env.step("The configuration is repaired.")  # no tool call: the episode ends
        await env.close()
        return read, missing, wrote, final

    read, missing, wrote, final = asyncio.run(go())
    assert "'debug': false" in read.messages[0]["content"]
    assert missing.info["tool_errors"] == 1 and "error" in missing.messages[0]["content"]
    assert wrote.messages[0]["content"].startswith("wrote ")
    assert final.done and final.reward == 1.0


def test_a_verifier_that_times_out_masks_the_episode(tmp_path) -> None:
    task = tmp_path / "slow"
    for rel, text in {
        "task.toml": "[verifier]\ntimeout_sec = 0.5\n",
        "instruction.md": "Wait.\n",
        "environment/Dockerfile": "FROM x\nWORKDIR /app\n",
        "tests/test.sh": "sleep 30\n",
    }.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    env = make_env("harbor", tasks=[str(task)], max_turns=2)

    async def go():
        await env.reset(env.make_task(0, 0))
        result = await env.step("<tool_call>submit</tool_call>")
        await env.close()
        return result

    result = asyncio.run(go())
    assert result.done and result.reward == 0.0 and result.info["masked"] == "verifier timeout"


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one of options.tasks"):
        make_env("harbor")
    with pytest.raises(ValueError, match="exactly one of options.tasks"):
        make_env("harbor", tasks=str(SHIPPED), generate=True)
