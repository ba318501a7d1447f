"""The shared episode logic of the built-in tool environments: turns, parsing, tool dispatch, counters.

A subclass gives its tools, its opening messages, `grade(answer)` for a final answer and, when a tool
result can end the episode (the guessing game), `after_tools`. Each step's `info` carries the step's
`tool_calls`, `tool_errors` and `tool_timeouts`; the last step's `info` also carries the episode
totals (`turns`, `tool_calls`, `tool_errors`, `tool_timeouts`) and `success`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from miles.agentic.envs.actions import normalize_action
from miles.agentic.envs.base import Action, Message, Observation, StepResult
from miles.agentic.envs.tools import Tool, ToolOutcome, run_tool_calls


class ToolEnv:
    """Base of environments whose episodes are: tool calls for a few turns, then a final answer."""

    name: ClassVar[str] = ""

    def __init__(self, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 (got {max_turns})")
        self.max_turns = max_turns
        self.task: dict[str, Any] = {}
        self.turns = 0
        self.done = False
        self.totals = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}
        self._tools: dict[str, Tool] = {}

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The OpenAI `tools` list of this environment."""
        return [t.schema() for t in self.tool_set().values()]

    def tool_set(self) -> dict[str, Tool]:
        """Tools by name (subclasses override)."""
        return self._tools

    def opening(self, task: dict[str, Any]) -> list[Message]:
        """The opening messages of an episode on `task` (subclasses override)."""
        raise NotImplementedError

    def grade(self, answer: str) -> float:
        """Reward of a final answer (subclasses override)."""
        raise NotImplementedError

    def after_tools(self, outcome: ToolOutcome) -> float | None:
        """A reward when a tool result ends the episode, else None."""
        return None

    async def setup(self) -> None:
        """Acquire what an episode needs (sandboxes); called by reset."""

    async def close(self) -> None:
        """Release what `setup` acquired; safe to call twice."""

    async def reset(self, task: dict[str, Any]) -> Observation:
        await self.close()
        self.task, self.turns, self.done = dict(task), 0, False
        self.totals = dict.fromkeys(self.totals, 0)
        await self.setup()
        return Observation(self.opening(self.task))

    async def step(self, action: Action) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.name}: step after the episode ended; call reset first")
        self.turns += 1
        tools = self.tool_set()
        prose, calls = normalize_action(action, {n: t.primary for n, t in tools.items()})
        if not calls:
            return self._finish(self.grade(prose), {})
        outcome = await run_tool_calls(tools, calls)
        info = {"tool_calls": len(calls), "tool_errors": outcome.errors, "tool_timeouts": outcome.timeouts}
        for key, value in info.items():
            self.totals[key] += value
        reward = self.after_tools(outcome)
        if reward is not None:
            return self._finish(reward, info, outcome.messages)
        if self.turns >= self.max_turns:
            return self._finish(0.0, info, outcome.messages)
        return StepResult(outcome.messages, 0.0, False, info)

    def _finish(
        self, reward: float, info: dict[str, Any], messages: list[Message] | None = None
    ) -> StepResult:
        self.done = True
        info = {**dict.fromkeys(self.totals, 0), **info}
        info["episode"] = {"turns": self.turns, **self.totals, "success": float(reward > 0)}
        info["success"] = reward > 0
        return StepResult(messages or [], reward, True, info)
