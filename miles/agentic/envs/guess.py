"""`guess`: find a secret integer in [low, high] with a `guess` tool that answers higher / lower.

    user:      guess 1 16
    assistant: <tool_call>guess 8</tool_call>
    tool:      higher
    assistant: <tool_call>guess 12</tool_call>
    tool:      lower
    assistant: <tool_call>guess 10</tool_call>
    tool:      correct                                     -> reward, done

A guess equal to the secret ends the episode with reward `1 - penalty * (guesses - 1)` (at least
`min_reward`); halving the range each turn is the policy to learn, so an episode needs several
turns. A turn without a tool call is a final answer: reward 1.0 when its last integer is the secret
(a lucky shot, no feedback), else 0.0. Running out of `max_turns` gives 0.0. A guess outside the
range or not an integer is a tool error.
"""

from __future__ import annotations

import random
from typing import Any

from miles.agentic.envs.base import Message
from miles.agentic.envs.calculator import last_int
from miles.agentic.envs.toolenv import ToolEnv
from miles.agentic.envs.tools import Tool, ToolError, ToolOutcome


class GuessEnv(ToolEnv):
    """The number-guessing game; see the module docstring."""

    name = "guess"

    def __init__(
        self,
        low: int = 1,
        high: int = 16,
        max_turns: int = 6,
        penalty: float = 0.1,
        min_reward: float = 0.2,
        prompt_prefix: str = "",
    ) -> None:
        super().__init__(max_turns)
        if high <= low:
            raise ValueError(f"guess: high must be > low (got low={low}, high={high})")
        self.low, self.high, self.penalty, self.min_reward = low, high, penalty, min_reward
        self.prompt_prefix = prompt_prefix
        self.guesses = 0
        self._found = False
        self._tools = {
            "guess": Tool(
                "guess",
                "Guess the secret number; the answer is higher, lower or correct.",
                {"n": {"type": "integer", "description": f"a number from {low} to {high}"}},
                self._guess,
            )
        }

    def make_task(self, seed: int, index: int) -> dict[str, Any]:
        rng = random.Random(f"guess:{seed}:{index}")
        return {"id": index, "low": self.low, "high": self.high, "secret": rng.randint(self.low, self.high)}

    def opening(self, task: dict[str, Any]) -> list[Message]:
        self.guesses, self._found = 0, False
        low, high = task.get("low", self.low), task.get("high", self.high)
        return [{"role": "user", "content": f"{self.prompt_prefix}guess {low} {high}"}]

    def grade(self, answer: str) -> float:
        return float(last_int(answer) == int(self.task["secret"]))

    def after_tools(self, outcome: ToolOutcome) -> float | None:
        if not self._found:
            return None
        return max(self.min_reward, 1.0 - self.penalty * (self.guesses - 1))

    async def _guess(self, n: Any) -> str:
        try:
            value = int(str(n).strip())
        except ValueError:
            raise ToolError(f"not an integer: {str(n)[:20]!r}") from None
        low, high = self.task.get("low", self.low), self.task.get("high", self.high)
        if not low <= value <= high:
            raise ToolError(f"out of range {low}..{high}")
        if self._found:
            return "correct"
        self.guesses += 1
        secret = int(self.task["secret"])
        if value == secret:
            self._found = True
            return "correct"
        return "higher" if secret > value else "lower"
