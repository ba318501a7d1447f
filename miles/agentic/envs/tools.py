"""Tools of the built-in environments: a schema, an async function, a time limit, and the dispatch that
turns calls into tool messages without ever raising.

Every call gets exactly one `tool` message: the tool's text, or `error: ...` for an unknown tool, bad
arguments, a malformed call, a tool that raised, or one that ran past its `timeout_s` (the coroutine
is cancelled; a tool that runs a process must stop it on cancellation, as `Sandbox.exec` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles.agentic.envs.base import MalformedCall, Message, ToolCall


class ToolError(Exception):
    """A tool's own refusal (bad input); its message is shown to the model as `error: ...`."""


@dataclass
class Tool:
    """One tool offered to the model."""

    name: str
    description: str
    parameters: dict[str, dict[str, Any]]
    """JSON-schema properties by argument name (all required)."""
    fn: Callable[..., Awaitable[str]]
    """Async function called with the arguments as keywords; returns the tool message text."""
    primary: str = ""
    """The argument the compact form `NAME VALUE` fills (default: the first parameter)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one call."""

    def __post_init__(self) -> None:
        self.primary = self.primary or next(iter(self.parameters))

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": self.parameters,
                    "required": list(self.parameters),
                },
            },
        }


@dataclass
class ToolOutcome:
    """The messages answering one turn's calls and what happened to them."""

    messages: list[Message]
    results: list[tuple[ToolCall | MalformedCall, str | None]]
    """Per call: the call and its text, or None where it failed."""
    errors: int = 0
    timeouts: int = 0


async def run_tool_calls(tools: dict[str, Tool], calls: list[ToolCall | MalformedCall]) -> ToolOutcome:
    """Run the calls one after another (order matters to stateful tools) and answer each."""
    outcome = ToolOutcome([], [])
    for i, call in enumerate(calls):
        call.id = call.id or f"call_{i}"
        text, ok, timed_out = await _run_one(tools, call)
        outcome.errors += not ok
        outcome.timeouts += timed_out
        outcome.results.append((call, text if ok else None))
        outcome.messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return outcome


async def _run_one(tools: dict[str, Tool], call: ToolCall | MalformedCall) -> tuple[str, bool, bool]:
    """(message text, succeeded, timed out)."""
    if isinstance(call, MalformedCall):
        return f"error: malformed tool call ({call.error})", False, False
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; known: {', '.join(sorted(tools))}", False, False
    missing = [k for k in tool.parameters if k not in call.arguments]
    extra = [k for k in call.arguments if k not in tool.parameters]
    if missing or extra:
        return f"error: {tool.name} takes {', '.join(tool.parameters)}", False, False
    try:
        return str(await asyncio.wait_for(tool.fn(**call.arguments), tool.timeout_s)), True, False
    except asyncio.TimeoutError:
        return f"error: {tool.name} timed out after {tool.timeout_s:g} s", False, True
    except ToolError as e:
        return f"error: {e}", False, False
    except Exception as e:  # a tool bug must not end the episode or the loop
        return f"error: {tool.name} failed ({type(e).__name__}: {e})", False, False
