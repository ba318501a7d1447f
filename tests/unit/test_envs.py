"""Built-in environments played by hand: rewards, tool errors, malformed calls, time limits, registry."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from miles.agentic.envs import Environment, load_env_class, make_env
from miles.agentic.envs.calculator import safe_eval
from miles.agentic.envs.tools import Tool, ToolError, run_tool_calls
from miles.rollout.tasks import EVAL_OFFSET


def play(env, task, turns):
    async def episode():
        obs = await env.reset(task)
        results = []
        for action in turns:
            results.append(await env.step(action))
            if results[-1].done:
                break
        await env.close()
        return obs, results

    return asyncio.run(episode())


def test_calculator_episode_compact_and_json_forms():
    env = make_env("calculator", num_ops=2, max_operand=99)
    assert isinstance(env, Environment) and env.tools[0]["function"]["name"] == "calc"
    task = env.make_task(seed=0, index=5)
    assert task == env.make_task(seed=0, index=5) and task != env.make_task(seed=0, index=EVAL_OFFSET + 5)
    call = json.dumps({"name": "calc", "arguments": {"expr": task["expr"]}})
    obs, results = play(
        env,
        task,
        [
            f"<tool_call>calc {task['expr']}</tool_call>",
            f"<tool_call>{call}</tool_call>",
            str(task["answer"]),
        ],
    )
    assert obs.messages == [{"role": "user", "content": task["expr"]}]
    assert [r.messages[0]["content"] for r in results[:2]] == [str(task["answer"])] * 2
    assert [r.reward for r in results] == [0.0, 0.0, 1.0] and results[-1].done
    assert results[-1].info["episode"] == {
        "turns": 3,
        "tool_calls": 2,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "success": 1.0,
    }


def test_calculator_wrong_answer_and_max_turns():
    env = make_env("calculator", max_turns=2)
    task = env.make_task(0, 1)
    _, wrong = play(env, task, [f"the answer is {task['answer'] + 1}"])
    assert wrong[-1].done and wrong[-1].reward == 0.0 and not wrong[-1].info["success"]
    _, loop = play(env, task, ["<tool_call>calc 1+1</tool_call>"] * 5)
    assert len(loop) == 2 and loop[-1].done and loop[-1].reward == 0.0


def test_malformed_calls_get_tool_errors_and_the_episode_goes_on():
    env = make_env("calculator")
    task = env.make_task(0, 2)
    turns = [
        '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>',  # bad JSON
        "<tool_call>calc 2+2",  # unclosed
        "<tool_call>search cats</tool_call>",  # unknown tool
        '<tool_call>{"name": "calc", "arguments": {"x": "1"}}</tool_call>',  # wrong argument
        "<tool_call>calc __import__('os').system('true')</tool_call>",  # not arithmetic
        "<tool_call>calc 9**9**9</tool_call>",  # too big
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        str(task["answer"]),
    ]
    _, results = play(make_env("calculator", max_turns=10), task, turns)
    texts = [r.messages[0]["content"] for r in results[:-1]]
    assert all(t.startswith("error: ") for t in texts), texts
    assert "invalid JSON" in texts[0] and "unclosed" in texts[1] and "unknown tool 'search'" in texts[2]
    assert results[-1].reward == 1.0 and results[-1].info["episode"]["tool_errors"] == 7
    assert results[6].messages[0]["tool_call_id"] == "c1"


def test_openai_message_actions():
    env = make_env("calculator")
    task = env.make_task(0, 3)
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_x",
                "type": "function",
                "function": {"name": "calc", "arguments": json.dumps({"expr": "6*7"})},
            }
        ],
    }
    _, results = play(env, task, [message, {"role": "assistant", "content": str(task["answer"])}])
    assert results[0].messages == [{"role": "tool", "tool_call_id": "call_x", "content": "42"}]
    assert results[1].reward == 1.0


def test_safe_eval():
    assert safe_eval("47*38+65") == 1851 and safe_eval("-(3-10)//2") == 3 and safe_eval("2**10 % 7") == 2
    for bad in ("open('x')", "1/2", "1//0", "a+1", "2**100**2", "x" * 300, "1.5*2"):
        with pytest.raises(ToolError):
            safe_eval(bad)


def test_guess_binary_search_and_lucky_answer():
    env = make_env("guess", low=1, high=16, max_turns=6)
    task = env.make_task(7, 0)
    secret = task["secret"]

    async def binary_search():
        await env.reset(task)
        low, high, feedback = 1, 16, []
        while True:
            mid = (low + high) // 2
            r = await env.step(f"<tool_call>guess {mid}</tool_call>")
            feedback.append(r.messages[0]["content"])
            if r.done:
                return r, feedback
            low, high = (mid + 1, high) if feedback[-1] == "higher" else (low, mid - 1)

    r, feedback = asyncio.run(binary_search())
    assert feedback[-1] == "correct" and set(feedback[:-1]) <= {"higher", "lower"}
    assert r.reward == pytest.approx(max(0.2, 1 - 0.1 * (len(feedback) - 1))) and r.info["success"]
    _, lucky = play(env, task, [f"it is {secret}"])
    assert lucky[0].done and lucky[0].reward == 1.0
    _, errors = play(env, task, ["<tool_call>guess 99</tool_call>", "<tool_call>guess ten</tool_call>"])
    assert [m.messages[0]["content"][:6] for m in errors] == ["error:", "error:"]


def test_hanging_tool_is_stopped_at_its_time_limit():
    async def hang(x: str) -> str:
        await asyncio.sleep(60)
        return "never"

    async def main():
        tools = {"slow": Tool("slow", "hangs", {"x": {"type": "string"}}, hang, timeout_s=0.2)}
        from miles.agentic.envs.base import ToolCall

        return await run_tool_calls(tools, [ToolCall("slow", {"x": "1"})])

    outcome = asyncio.run(main())
    assert outcome.timeouts == 1 and "timed out" in outcome.messages[0]["content"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_calculator_in_a_sandbox_kills_a_hanging_expression():
    env = make_env("calculator", backend="sandbox", tool_timeout_s=3.0)
    task = env.make_task(0, 4)
    turns = [
        f"<tool_call>calc {task['expr']}</tool_call>",
        "<tool_call>calc [i for i in iter(int, 1)]</tool_call>",  # never ends
        str(task["answer"]),
    ]
    _, results = play(env, task, turns)
    assert results[0].messages[0]["content"] == str(task["answer"])
    assert results[1].messages[0]["content"].startswith("error:")
    assert results[1].info["tool_errors"] == 1 and results[2].reward == 1.0
    assert env._sandboxes.sandbox is None  # closed with the episode


def test_registry_by_name_and_dotted_path():
    assert load_env_class("calculator") is load_env_class("miles.agentic.envs.calculator:CalculatorEnv")
    assert load_env_class("miles.agentic.envs.guess.GuessEnv").name == "guess"
    with pytest.raises(ValueError, match="known: .*calculator"):
        load_env_class("nope")
    with pytest.raises(ValueError, match="bad options"):
        make_env("guess", colour="red")
