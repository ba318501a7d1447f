"""Bounded servers: a model reply of a thousand brackets after `<tool_call>` is a parsed failure in the
engine's OpenAI route and in the session server, not a 500; the session server answers 413 naming the
limit for a body or a message too large, 429 past its cap of sessions, closes idle sessions, takes
its API key, and serves a small session while another's long prompt is being rendered."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from miles.agentic.session_server import SessionServer
from miles.chat.toolcalls import parse_tool_calls
from miles.engine.process import start_engine
from miles.rollout.client import SGLangClient
from miles.serving import ApiKeys

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
]


@pytest.mark.parametrize("family", ["chatml", "qwen3", "llama3"])
@pytest.mark.parametrize("depth", [960, 5000])
def test_deeply_nested_tool_calls_are_malformed_not_errors(family, depth) -> None:
    for text in (
        "<tool_call>" + "[" * depth,
        "<tool_call>" + "[" * depth + "]" * depth + "</tool_call>",
        '<tool_call>{"name": "add", "arguments": ' + "[" * depth + "]" * depth + "}</tool_call>",
        '{"name": "add", "parameters": ' + "{" * depth + "}" * depth + "}",
    ):
        parsed = parse_tool_calls(text, family)
        assert parsed.tool_calls == []


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("bounds") / "engine.log")
    yield proc
    proc.stop()


# forces the reply that ended in a RecursionError (HTTP 500) before: `<tool_call>` and 960 `[`
DEEP = r"<tool_call>" + r"\[" * 960


def test_the_engines_openai_route_answers_a_deep_tool_call(engine) -> None:
    reply = httpx.post(
        engine.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "go"}],
            "tools": TOOLS,
            "regex": DEEP,
            "max_tokens": 1000,
            "temperature": 0.0,
        },  # fmt: skip
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    assert not reply.json()["choices"][0]["message"].get("tool_calls")


def _serve(engine, tiny_model, scenario, **options):
    async def main():
        client = SGLangClient(engine.url)
        server = SessionServer([client], tiny_model, max_new_tokens=8, **options)
        await server.start()
        try:
            return await scenario(server)
        finally:
            await server.stop()
            await client.aclose()

    return asyncio.run(main())


def test_session_server_limits_caps_and_expiry(engine, tiny_model) -> None:
    async def scenario(server: SessionServer):
        async with httpx.AsyncClient(timeout=120) as http:
            # a deep tool call through the session server: parsed as a failure, answered 200
            sid, base = server.open_session()
            body = {"model": "t", "messages": [{"role": "user", "content": "go"}], "tools": TOOLS,
                    "regex": DEEP, "max_tokens": 1000, "temperature": 0.0}  # fmt: skip
            r = await http.post(base + "/chat/completions", json=body)
            assert r.status_code == 200 and not r.json()["choices"][0]["message"].get("tool_calls"), r.text
            # a body over max_request_bytes, a message over max_message_chars
            r = await http.post(base + "/chat/completions", content=b"x" * 70_000)
            assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]
            big = {"model": "t", "messages": [{"role": "user", "content": "y" * 5000}], "max_tokens": 2}
            r = await http.post(base + "/chat/completions", json=big)
            assert r.status_code == 413 and "max_message_chars" in r.json()["error"]["message"]
            # the cap on open sessions
            r = await http.post(server.url + "/sessions", json={})
            assert r.status_code == 200
            r = await http.post(server.url + "/sessions", json={})
            assert r.status_code == 429 and "max_sessions" in r.json()["error"]["message"]
            # idle expiry: the sessions untouched for longer than the timeout are closed
            server.session_idle_timeout_s = 0.2
            await asyncio.sleep(0.5)
            r = await http.post(
                base + "/chat/completions", json={**big, "messages": [{"role": "user", "content": "hi"}]}
            )
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_expired"
            assert not server.sessions

    _serve(engine, tiny_model, scenario, max_request_bytes=64_000, max_message_chars=4000, max_sessions=2)


def test_session_server_takes_its_key_and_a_long_prompt_does_not_stall_others(engine, tiny_model) -> None:
    async def scenario(server: SessionServer):
        async with httpx.AsyncClient(timeout=300) as http:
            assert (await http.post(server.url + "/sessions", json={})).status_code == 401
            auth = {"Authorization": "Bearer k"}
            _, long_base = server.open_session()
            _, short_base = server.open_session()
            finished: list[str] = []

            async def call(base: str, content: str, name: str) -> None:
                oai = openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0, timeout=300)
                try:  # the long prompt is longer than the engine's KV cache: it ends in a 400, once rendered
                    await oai.chat.completions.create(model="t", messages=[{"role": "user", "content": content}],
                                                      max_tokens=1, temperature=0.0)  # fmt: skip
                except openai.BadRequestError:
                    assert name == "long"
                finished.append(name)
                await oai.close()

            long_call = asyncio.ensure_future(call(long_base, "word " * 400_000, "long"))
            await asyncio.sleep(0.3)  # the long prompt is being rendered and tokenized
            await call(short_base, "hi", "short")
            await long_call
            assert finished == ["short", "long"]
            assert (await http.get(server.url + "/sessions/x", headers=auth)).status_code == 404

    _serve(engine, tiny_model, scenario, keys=ApiKeys(api="k"), max_request_bytes=8 * 2**20)
