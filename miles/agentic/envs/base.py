"""The environment protocol: one episode of a multi-turn task with tools, and the registry of environments.

An episode is `reset(task)` (the opening messages), then `step(action)` per assistant turn until a
`StepResult` says `done`. An action is either the assistant's raw text (the environment parses tool
calls out of it, both the standard `<tool_call>{json}</tool_call>` form and the compact form of
`miles.agentic.envs.actions`), its OpenAI assistant message, or tool calls the caller already parsed. A turn with tool calls gets
one `tool` message per call back; a turn without tool calls is the final answer and ends the
episode with its reward. A malformed tool call is answered with a tool-error message and the episode
goes on; a tool that runs past its time limit is stopped and answered with a timeout message.

Environments are found by name in `ENVIRONMENTS` or by dotted path (`package.module:Class` or
`package.module.Class`); `make_env` builds one from either.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

Message = dict[str, Any]
"""An OpenAI chat message: {"role": ..., "content": ..., optionally "tool_calls" / "tool_call_id"}."""


@dataclass
class ToolCall:
    """One call of a tool by the model, arguments already decoded from JSON (or from the compact form)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""
    """The call id the tool message answers (OpenAI `tool_call_id`); made up when the model gave none."""


@dataclass
class MalformedCall:
    """A tool call the model tried to make but that could not be parsed; it earns a tool-error message."""

    text: str
    """The offending text, as the model wrote it."""
    error: str
    """Why it could not be parsed (shown to the model)."""
    id: str = ""


Action = str | dict[str, Any] | list[Any]
"""What `step` takes: the assistant's raw text, its OpenAI message dict (`content` + `tool_calls`),
or its calls parsed by the caller (ToolCall / MalformedCall, or OpenAI `tool_calls` entries)."""


@dataclass
class Observation:
    """What an episode opens with."""

    messages: list[Message]
    """The opening messages (system and/or user) of the conversation."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The last message's content: the prompt of a plain-text (non-chat) rollout."""
        return str(self.messages[-1]["content"]) if self.messages else ""


@dataclass
class StepResult:
    """What the environment answers to one assistant turn."""

    messages: list[Message]
    """Messages appended after the assistant turn (tool results, feedback); empty when done."""
    reward: float = 0.0
    """Reward of this step; the episode's return is the sum over its steps."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Counters of this step: `tool_calls`, `tool_errors`, `tool_timeouts`; at the end `success`."""


@runtime_checkable
class Environment(Protocol):
    """One episode at a time of a multi-turn task.

    Implementations must: build no processes or sandboxes in `__init__` (do it in `reset`), answer
    every tool call with exactly one tool message (errors included), never raise on model output
    however malformed, end the episode (`done=True`) at `max_turns` assistant turns at the latest,
    and release everything in `close` (idempotent). `tools` is the OpenAI `tools` list offered to
    the model. `make_task(seed, index)` is deterministic in its arguments; indices at and above
    `miles.rollout.tasks.EVAL_OFFSET` are held out for evaluation.
    """

    name: ClassVar[str]
    tools: list[dict[str, Any]]
    max_turns: int

    def make_task(self, seed: int, index: int) -> dict[str, Any]:
        """The index-th procedural task (a JSON-able dict) of the stream seeded by `seed` (options apply)."""
        ...

    async def reset(self, task: dict[str, Any]) -> Observation:
        """Start an episode on `task`; returns the opening messages."""
        ...

    async def step(self, action: Action) -> StepResult:
        """Answer one assistant turn."""
        ...

    async def close(self) -> None:
        """Release what the episode holds (sandboxes, processes); safe to call twice."""
        ...


def _builtin_envs() -> dict[str, str]:
    return {
        "calculator": "miles.agentic.envs.calculator:CalculatorEnv",
        "guess": "miles.agentic.envs.guess:GuessEnv",
        "lookup": "miles.agentic.tasks:LookupEnv",
        "openenv": "miles.agentic.envs.adapters.openenv:OpenEnvEnv",
        "harbor": "miles.agentic.harbor.env:HarborEnv",
    }


ENVIRONMENTS: dict[str, str] = _builtin_envs()
"""Built-in environments by name -> dotted path of the class (imported on first use)."""


def load_env_class(name_or_path: str) -> type:
    """The environment class named `name_or_path`: a key of ENVIRONMENTS or `module:Class` / `module.Class`."""
    target = ENVIRONMENTS.get(name_or_path, name_or_path)
    if ":" in target:
        module_name, _, attr = target.partition(":")
    elif "." in target:
        module_name, _, attr = target.rpartition(".")
    else:
        raise ValueError(
            f"unknown environment {name_or_path!r}; known: {', '.join(sorted(ENVIRONMENTS))} "
            "(or give a dotted path such as my_pkg.my_env:MyEnv)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"environment {name_or_path!r}: cannot import module {module_name!r} ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"environment {name_or_path!r}: module {module_name!r} has no {attr!r}") from None


def make_env(name_or_path: str, **options: Any) -> Environment:
    """Build an environment by name or dotted path with its options (e.g. from `rollout.env.options`)."""
    cls = load_env_class(name_or_path)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"environment {name_or_path!r}: bad options {sorted(options)} ({e})") from e


def env_options(name_or_path: str, options: dict[str, Any], sandbox: Any = None) -> dict[str, Any]:
    """`rollout.env.options`, plus `rollout.env.sandbox` as the constructor option an environment
    class names in its `sandbox_option` attribute (harbor: `backend`); environments without one have
    no container sandboxes to place and get nothing."""
    options = dict(options)
    key = getattr(load_env_class(name_or_path), "sandbox_option", None) if sandbox is not None else None
    if key is not None:
        options[key] = sandbox
    return options
