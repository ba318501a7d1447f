"""Verifiers v1 tasksets as a Miles agent function: one task's episode run by Verifiers against a
Miles session's OpenAI `base_url`, its reward returned.

Written for `verifiers` 0.4 (the v1 API only; extra `miles[verifiers]`). What Verifiers does for an
episode, and so what this adapter relies on:
- `load_environment(resolve_env_config({...}))` builds the env of a taskset id (a built-in taskset
  or an installed package exporting its `Taskset` subclass in `__all__`);
- the agent seat runs a harness program (`null`: a plain chat loop, tools served over MCP) in a
  runtime (`subprocess`: on this host); its model calls go through Verifiers' interception server,
  which forwards them (streaming, `stream=true`) to the `ModelContext`'s client `base_url`: here
  the Miles session server, which records the tokens for training;
- `env.run_episode(task, ctx)` inside `env.serving()` returns an `Episode` whose traces carry the
  taskset's `@reward` scores (`trace.reward`, the weighted sum) and `@metric` values.
Verifiers prepares harness scripts with `uv`, which must be on PATH (with a package index reachable
the first time, or a warm uv cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AgentOutcome:
    """What an agent function returns for one episode."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    """`ok`, `errors` (messages), `metrics` (mean over traces), `turns`."""


def _require_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(
            "the Verifiers adapter needs the `verifiers` package (v1 API, 0.4.x): pip install 'miles[verifiers]'"
        ) from e
    return vf


class VerifiersAgent:
    """Runs episodes of one Verifiers taskset through a given OpenAI base_url.

    `env` is the Verifiers env config as a dict (e.g. `{"taskset": {"id": "my-taskset"}}`); the
    agent seat defaults to the `null` harness in the local `subprocess` runtime.
    """

    def __init__(
        self,
        env: dict[str, Any],
        harness: str = "null",
        api_key_var: str = "OPENAI_API_KEY",
        max_turns: int | None = None,
    ) -> None:
        agent = {"harness": {"id": harness}, "runtime": {"type": "subprocess"}}
        if max_turns is not None:
            agent["max_turns"] = max_turns
        self.config = {**env, "agent": {**agent, **env.get("agent", {})}}
        self.api_key_var = api_key_var
        self._env: Any = None

    def environment(self) -> Any:
        """The loaded Verifiers env (built once)."""
        if self._env is None:
            _require_verifiers()
            from verifiers.v1.utils.loaders import load_environment, resolve_env_config

            self._env = load_environment(resolve_env_config(self.config))
        return self._env

    def tasks(self, n: int, seed: int | None = None) -> list[dict[str, Any]]:
        """The first `n` tasks of the taskset (shuffled by `seed` when given), as wire data dicts."""
        taskset = self.environment().taskset
        view = taskset.shuffle(seed) if seed is not None else taskset
        return [_task_data(t) for t in view.take(n)]

    async def __call__(self, task: dict[str, Any], base_url: str, model: str) -> AgentOutcome:
        """Run one episode of `task` with the model served at `base_url`; never raises for what the
        episode does (errors come back in `info`)."""
        vf = _require_verifiers()
        env = self.environment()
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=self.api_key_var)
        ctx = vf.ModelContext(model=model, client=client)
        task_cls = type(env.taskset).task_type()
        task_obj = task_cls(task_cls.data_type().model_validate(task), env.taskset.config.task)
        async with env.serving():
            episode = await env.run_episode(task_obj, ctx)
        return outcome(episode)


def _task_data(task: Any) -> dict[str, Any]:
    return task.data.model_dump(mode="json", exclude_none=True)


def outcome(episode: Any) -> AgentOutcome:
    """Reward and info of a Verifiers `Episode` (the sum of its traces' weighted rewards)."""
    traces = list(episode.traces)
    reward = sum(float(t.reward) for t in traces)
    metrics: dict[str, float] = {}
    for t in traces:
        for key, value in (t.metrics or {}).items():
            if value is not None:
                metrics[key] = metrics.get(key, 0.0) + float(value) / len(traces)
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    errors += [f"{e.type}: {e.message}" for t in traces for e in t.errors]
    return AgentOutcome(
        reward, {"ok": bool(episode.ok), "errors": errors, "metrics": metrics, "traces": len(traces)}
    )
