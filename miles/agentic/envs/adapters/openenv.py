"""OpenEnv environments (the `openenv-core` server protocol) as Miles environments.

An OpenEnv environment is a server: `POST /reset` and `POST /step` are stateless (a fresh
environment per request), so an episode runs over its WebSocket `/ws`, one environment per
connection: `{"type": "reset", "data": {...}}`, `{"type": "step", "data": <action>}`,
`{"type": "close"}`; each answered by `{"type": "observation", "data": {"observation": {...},
"reward": float | null, "done": bool}}` or `{"type": "error", "data": {"message", "code"}}`.
`GET /schema` gives the JSON schemas of actions and observations.

Two ways to act, chosen by `mode`:
- `text`: the assistant's text (its prose, tool-call blocks removed) becomes the action's
  `action_field` (e.g. the echo environment's `message`); the observation comes back as a user
  message.
- `tool`: the environment is offered as one tool (`tool_name`) whose parameters are the action's
  schema; each call is one step and is answered by a tool message. A turn without a call ends the
  episode. The compact call form fills the action's first field.
The observation shown is `observation_field` of the observation, or all of it as compact JSON. An
error from the server (an invalid action) is shown to the model and the episode goes on. Rewards are
the server's, summed over the episode. Only the wire protocol is used here: the `openenv-core`
package is needed by the server, not by this adapter.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from miles.agentic.envs.actions import normalize_action
from miles.agentic.envs.base import Action, MalformedCall, Message, Observation, StepResult


class OpenEnvError(RuntimeError):
    """The OpenEnv server could not be reached or broke the protocol."""


class OpenEnvEnv:
    """One OpenEnv server as an Environment; see the module docstring."""

    name: ClassVar[str] = "openenv"

    def __init__(
        self,
        url: str,
        mode: str = "text",
        action_field: str = "message",
        observation_field: str | None = None,
        tool_name: str = "act",
        max_turns: int = 8,
        prompt: str = "",
        reset_options: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if mode not in ("text", "tool"):
            raise ValueError(f"openenv: mode must be 'text' or 'tool' (got {mode!r})")
        self.url, self.mode, self.action_field = url.rstrip("/"), mode, action_field
        self.observation_field, self.tool_name, self.max_turns = observation_field, tool_name, max_turns
        self.prompt, self.reset_options, self.timeout_s = prompt, dict(reset_options or {}), timeout_s
        self.tools: list[dict[str, Any]] = []
        self._action_schema: dict[str, Any] = {}
        self._session: Any = None
        self._ws: Any = None
        self.turns = 0
        self.total_reward = 0.0
        self.done = False

    def make_task(self, seed: int, index: int) -> dict[str, Any]:
        return {"id": index, "seed": (seed * 1_000_003 + index) % (1 << 31)}

    async def reset(self, task: dict[str, Any]) -> Observation:
        await self.close()
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            if self.mode == "tool" and not self.tools:
                await self._load_schema()
            self._ws = await self._session.ws_connect(f"{self.url}/ws")
        except aiohttp.ClientError as e:
            await self.close()
            raise OpenEnvError(
                f"openenv: cannot reach {self.url} ({e}); is the environment server up?"
            ) from e
        data = {**self.reset_options, **task.get("reset", {})}
        if task.get("seed") is not None:
            data.setdefault("seed", task["seed"])
        reply = await self._send({"type": "reset", "data": data})
        if reply["type"] != "observation":
            raise OpenEnvError(f"openenv: reset failed: {reply['data']}")
        self.turns, self.total_reward, self.done = 0, 0.0, False
        text = self._render(reply["data"].get("observation", {}))
        return Observation([{"role": "user", "content": f"{self.prompt}{text}"}], {"openenv": reply["data"]})

    async def step(self, action: Action) -> StepResult:
        if self._ws is None or self.done:
            raise RuntimeError("openenv: step before reset or after the episode ended")
        self.turns += 1
        if self.mode == "text":
            prose, _ = normalize_action(action, {})
            messages, reward, done, errors = await self._act({self.action_field: prose}, "user", None)
            info = {"tool_calls": 0, "tool_errors": errors, "tool_timeouts": 0}
        else:
            messages, reward, done, info = await self._tool_turn(action)
        self.total_reward += reward
        if done or self.turns >= self.max_turns:
            self.done = True
            info = {**info, "success": self.total_reward > 0, "episode": {"turns": self.turns}}
            return StepResult(messages, reward, True, info)
        return StepResult(messages, reward, False, info)

    async def _tool_turn(self, action: Action) -> tuple[list[Message], float, bool, dict[str, Any]]:
        first = next(iter(self._action_schema.get("properties", {})), self.action_field)
        _, calls = normalize_action(action, {self.tool_name: first})
        if not calls:
            return [], 0.0, True, {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}
        messages: list[Message] = []
        reward, done, errors = 0.0, False, 0
        for i, call in enumerate(calls):
            call_id = call.id or f"call_{i}"
            if isinstance(call, MalformedCall) or call.name != self.tool_name or done:
                why = "the episode ended" if done else getattr(call, "error", f"unknown tool {call.name!r}")
                messages.append({"role": "tool", "tool_call_id": call_id, "content": f"error: {why}"})
                errors += 1
                continue
            out, r, done, bad = await self._act(call.arguments, "tool", call_id)
            messages += out
            reward, errors = reward + r, errors + bad
        return messages, reward, done, {"tool_calls": len(calls), "tool_errors": errors, "tool_timeouts": 0}

    async def _act(self, action: dict[str, Any], role: str, call_id: str | None):
        """One step on the server: (messages, reward, done, 1 if the server refused the action)."""
        reply = await self._send({"type": "step", "data": action})
        message: Message = {"role": role}
        if call_id is not None:
            message["tool_call_id"] = call_id
        if reply["type"] != "observation":
            detail = reply.get("data", {})
            message["content"] = f"error: {detail.get('message', detail)}"[:500]
            return [message], 0.0, False, 1
        data = reply["data"]
        message["content"] = self._render(data.get("observation", {}))
        return [message], float(data.get("reward") or 0.0), bool(data.get("done")), 0

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        await self._ws.send_str(json.dumps(message))
        raw = await self._ws.receive(timeout=self.timeout_s)
        try:
            reply = json.loads(raw.data)
        except (TypeError, json.JSONDecodeError):
            raise OpenEnvError(f"openenv: the server closed or sent non-JSON ({raw.type})") from None
        if reply.get("type") not in ("observation", "error"):
            raise OpenEnvError(f"openenv: unexpected reply type {reply.get('type')!r}")
        return reply

    async def _load_schema(self) -> None:
        async with self._session.get(f"{self.url}/schema") as resp:
            resp.raise_for_status()
            schema = (await resp.json())["action"]
        props = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        self._action_schema = {"type": "object", "properties": props, "required": schema.get("required", [])}
        description = schema.get("description") or "Act in the environment."
        self.tools = [
            {
                "type": "function",
                "function": {
                    "name": self.tool_name,
                    "description": description,
                    "parameters": self._action_schema,
                },
            }
        ]

    def _render(self, observation: dict[str, Any]) -> str:
        if self.observation_field is not None:
            return str(observation.get(self.observation_field, ""))
        return json.dumps(observation, separators=(",", ":"), ensure_ascii=False)

    async def close(self) -> None:
        ws, session, self._ws, self._session = self._ws, self._session, None, None
        if ws is not None and not ws.closed:
            try:
                await ws.send_str(json.dumps({"type": "close"}))
            except Exception:  # the server may be gone already; closing must not fail
                pass
            await ws.close()
        if session is not None:
            await session.close()
