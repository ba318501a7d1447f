"""`lookup`: a tool task a tiny model learns in minutes.

Its episodes come numbered by the `env` task (`EpisodeTask` in miles/rollout/tasks.py): training
prompt i stands for the environment task `make_task(seed, i)`, held-out prompt j for
`make_task(seed, EVAL_OFFSET + j)`; the generate function (miles/agentic/rollout.py) builds the
environment of `rollout.env` and asks it for the task.

`LookupEnv` is a two-turn retrieval episode sized for the tiny random-initialised model (digits are
single tokens, a turn can be one token):

    user:      "value 4"                 the key (a digit)
    assistant: "4"                       turn 1 is a tool call in compact form: the key to look up
    tool:      "7"                       the episode's secret table at that key (random per episode)
    assistant: "7"                       turn 2 is the final answer

The table is drawn per episode, so the answer can only be known by calling the tool with the
prompt's key and copying the tool's result: both turns are "copy the latest digit", which RL
discovers from a random model. The standard form `<tool_call>{"name": "lookup", "arguments": {"key":
4}}</tool_call>` (or the compact `<tool_call>lookup 4</tool_call>`) is accepted too. A call turn with
no key earns a tool error and the episode goes on, until `max_turns`.

Reward (in [0, 1]; success is reward 1):

    r = 1                                                          answer == table[key]
    r = partial * ([a call parsed] + [call == key] + [answer == table[call]])     otherwise

The partial credit (`partial`, default 0.2, at most 2 * partial without success) rewards each skill
alone, so a group of episodes has reward variance long before whole episodes succeed. The tool error
is the word `error` (no digit in it: a digit there would be a thing to copy).
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from miles.agentic.envs.base import Message, Observation, StepResult
from miles.config import ConfigError

_DIGIT = re.compile(r"\d")


class LookupEnv:
    """Look a key up with a tool, answer with what it returned (module docstring)."""

    name: ClassVar[str] = "lookup"
    tools: list[dict[str, Any]] = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "The value stored at a key (0-9).",
                "parameters": {
                    "type": "object",
                    "properties": {"key": {"type": "integer"}},
                    "required": ["key"],
                },
            },
        }
    ]

    def __init__(self, max_turns: int = 3, keys: int = 10, partial: float = 0.2) -> None:
        if max_turns < 2 or not 1 <= keys <= 10 or not 0 <= partial < 0.5:
            raise ConfigError(
                "rollout.env.options for lookup need max_turns >= 2, 1 <= keys <= 10 and 0 <= partial < 0.5 "
                f"(got {max_turns}, {keys}, {partial})"
            )
        self.max_turns, self.keys, self.partial = max_turns, keys, partial
        self._task: dict[str, Any] = {}
        self._turn = 0
        self._called: int | None = None

    def make_task(self, seed: int, index: int) -> dict[str, Any]:
        rng = random.Random(f"lookup:{seed}:{index}")
        return {"key": rng.randrange(self.keys), "table": [rng.randrange(10) for _ in range(self.keys)]}

    async def reset(self, task: dict[str, Any]) -> Observation:
        self._task, self._turn, self._called = dict(task), 0, None
        return Observation([{"role": "user", "content": f"value {task['key']}"}], {"task": task})

    async def step(self, action: Any) -> StepResult:
        self._turn += 1
        text = action if isinstance(action, str) else ""
        if self._called is None:
            return self._call(text, action)
        digit = _DIGIT.search(text)
        answer = int(digit.group(0)) if digit else None
        return self._finish(answer)

    def _call(self, text: str, action: Any) -> StepResult:
        """A call turn: the key in compact form (its first digit) or in a standard call."""
        key = _call_key(text, action)
        if key is None or key >= self.keys:
            if self._turn >= self.max_turns - 1:  # no turn left for an answer
                return self._finish(None, errors=1)
            return StepResult([_tool("error")], info={"tool_calls": 1, "tool_errors": 1})
        self._called = key
        return StepResult([_tool(str(self._task["table"][key]))], info={"tool_calls": 1, "tool_errors": 0})

    def _finish(self, answer: int | None, errors: int = 0) -> StepResult:
        table, key = self._task["table"], self._task["key"]
        success = answer is not None and answer == table[key]
        called = self._called
        if success:
            reward = 1.0
        else:
            copied = answer is not None and called is not None and answer == table[called]
            reward = self.partial * (float(called is not None) + float(called == key) + float(copied))
        info = {"success": float(success), "tool_calls": float(errors), "tool_errors": float(errors)}
        return StepResult([], reward=reward, done=True, info=info)

    async def close(self) -> None:
        return None


def _tool(content: str) -> Message:
    return {"role": "tool", "content": content}


def _call_key(text: str, action: Any) -> int | None:
    """The key of a call turn: from parsed calls, a `<tool_call>` block, or the text's first digit."""
    if not isinstance(action, str):
        calls = [c for c in action if getattr(c, "name", None) == "lookup"]
        return _int(calls[0].arguments.get("key")) if calls else None
    if "<tool_call>" in text:
        from miles.agentic.envs.actions import parse_tool_calls

        _, calls = parse_tool_calls(text, {"lookup": "key"})
        return _call_key("", calls)
    digit = _DIGIT.search(text)
    return int(digit.group(0)) if digit else None


def _int(value: Any) -> int | None:
    try:
        return int(str(value).strip())
    except ValueError:
        return None
