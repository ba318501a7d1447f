"""Adapters against real loopback servers: an OpenEnv server (openenv-core's own app) and Verifiers."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest


def serve(app) -> tuple[str, Any]:
    """Serve an ASGI app with uvicorn on a port the OS picks; (base URL, server)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="auto"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started, "the OpenEnv server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", server


@pytest.fixture(scope="module")
def openenv_url():
    pytest.importorskip(
        "openenv.core.env_server", reason="openenv-core is not installed (pip install 'miles[openenv]')"
    )
    from openenv.core.env_server import Environment, create_fastapi_app
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        n: int

    class GuessObservation(Observation):
        hint: str = ""

    class SecretEnv(Environment):
        """Guess the secret (seed % 10): higher / lower / correct, reward 1 when found."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.secret, self.steps = 0, 0

        def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
            self.secret, self.steps = (seed or 0) % 10, 0
            return GuessObservation(hint="guess 0-9")

        def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
            self.steps += 1
            if action.n == self.secret:
                return GuessObservation(hint="correct", reward=1.0, done=True)
            return GuessObservation(hint="higher" if self.secret > action.n else "lower", reward=0.0)

        @property
        def state(self) -> State:
            return State(step_count=self.steps)

    app = create_fastapi_app(SecretEnv, GuessAction, GuessObservation, max_concurrent_envs=4)
    url, server = serve(app)
    yield url
    server.should_exit = True


@pytest.mark.slow  # importing openenv-core's server stack takes seconds
def test_openenv_tool_mode_episode(openenv_url):
    from miles.agentic.envs import make_env

    env = make_env("openenv", url=openenv_url, mode="tool", observation_field="hint", max_turns=6)

    async def episode():
        obs = await env.reset({"seed": 7})
        tools = env.tools
        turns = [
            "<tool_call>act 3</tool_call>",  # compact form fills the action's first field
            '<tool_call>{"name": "act", "arguments": {"n": "many"}}</tool_call>',  # refused by the server
            '<tool_call>{"name": "act", "arguments": {"n": 9}}</tool_call>',
            "<tool_call>act 7</tool_call>",
        ]
        results = [await env.step(t) for t in turns]
        await env.close()
        return obs, tools, results

    obs, tools, results = asyncio.run(episode())
    assert obs.messages == [{"role": "user", "content": "guess 0-9"}]
    assert tools[0]["function"]["name"] == "act" and "n" in tools[0]["function"]["parameters"]["properties"]
    assert "metadata" not in tools[0]["function"]["parameters"]["properties"]
    contents = [r.messages[0]["content"] for r in results]
    assert contents[0] == "higher" and contents[1].startswith("error:") and contents[2] == "lower"
    assert contents[3] == "correct" and results[3].done and results[3].reward == 1.0
    assert results[1].info["tool_errors"] == 1 and not results[1].done
    assert results[3].info["success"]


@pytest.mark.slow
def test_openenv_text_mode_and_sessions_are_independent(openenv_url):
    from miles.agentic.envs.adapters.openenv import OpenEnvEnv

    async def play(seed: int, guesses: list[str]) -> list[Any]:
        env = OpenEnvEnv(openenv_url, mode="text", action_field="n", observation_field="hint")
        await env.reset({"seed": seed})
        out = []
        for g in guesses:
            out.append(await env.step(g))
            await asyncio.sleep(0)
        await env.close()
        return out

    async def both():
        return await asyncio.gather(play(2, ["5", "2"]), play(8, ["5", "8"]))

    a, b = asyncio.run(both())
    assert [r.messages[0]["content"] for r in a] == ["lower", "correct"]
    assert [r.messages[0]["content"] for r in b] == ["higher", "correct"]
    assert a[-1].done and b[-1].reward == 1.0


def test_openenv_unreachable_server_names_the_url():
    from miles.agentic.envs.adapters.openenv import OpenEnvEnv, OpenEnvError

    pytest.importorskip("aiohttp")
    env = OpenEnvEnv("http://127.0.0.1:9", mode="text")
    with pytest.raises(OpenEnvError, match="127.0.0.1:9"):
        asyncio.run(env.reset({}))


TASKSET_MODULE = '''
"""A two-task Verifiers taskset: the model must say the number in the prompt."""
import verifiers.v1 as vf


class SayData(vf.TaskData):
    answer: str = ""


class SayTask(vf.Task[SayData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)


class SayTaskset(vf.Taskset[SayTask]):
    def load(self):
        for n in ("42", "7"):
            yield SayTask(SayData(prompt=f"say {n}", answer=n), self.config.task)


__all__ = ["SayTaskset"]
'''


def openai_loopback(reply) -> tuple[str, list[dict], Any]:
    """A loopback OpenAI chat-completions server (plain and SSE streaming) answering `reply(messages)`."""
    import json

    from aiohttp import web

    seen: list[dict] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        text = reply(body["messages"])
        base = {"id": "chatcmpl-1", "created": 0, "model": body.get("model", "m")}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return web.json_response(
                {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delta, finish in (
            ({"role": "assistant", "content": ""}, None),
            ({"content": text}, None),
            ({}, "stop"),
        ):
            chunk = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}/v1", seen, (loop, runner)


@pytest.mark.slow  # Verifiers starts its interception server and a harness program per episode
def test_verifiers_taskset_rewards_through_our_base_url(tmp_path, monkeypatch):
    import shutil

    pytest.importorskip(
        "verifiers.v1", reason="verifiers (v1 API, 0.4.x) is not installed: pip install 'miles[verifiers]'"
    )
    if shutil.which("uv") is None:
        pytest.skip("Verifiers prepares its harness programs with uv, which is not on PATH")
    from miles.agentic.envs.adapters.verifiers import VerifiersAgent

    (tmp_path / "miles_say_taskset.py").write_text(TASKSET_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OPENAI_API_KEY", "unused-by-the-loopback-server")
    base_url, seen, _ = openai_loopback(lambda messages: messages[-1]["content"].split()[-1])
    agent = VerifiersAgent({"taskset": {"id": "miles_say_taskset"}})
    tasks = agent.tasks(2)
    assert [t["answer"] for t in tasks] == ["42", "7"]
    good = asyncio.run(agent(tasks[0], base_url, "tiny"))
    assert good.reward == 1.0 and good.info["ok"], good.info
    assert seen and seen[-1]["messages"][-1]["content"] == "say 42"

    wrong = VerifiersAgent({"taskset": {"id": "miles_say_taskset"}})
    base_url2, _, _ = openai_loopback(lambda messages: "nothing")
    bad = asyncio.run(wrong(tasks[1], base_url2, "tiny"))
    assert bad.reward == 0.0


def test_verifiers_agent_config_and_missing_package_message():
    from miles.agentic.envs.adapters.verifiers import VerifiersAgent

    agent = VerifiersAgent({"taskset": {"id": "t"}, "agent": {"max_turns": 3}}, harness="bash")
    assert agent.config["agent"] == {
        "harness": {"id": "bash"},
        "runtime": {"type": "subprocess"},
        "max_turns": 3,
    }
    try:
        import verifiers.v1  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'miles\[verifiers\]'"):
            agent.environment()
