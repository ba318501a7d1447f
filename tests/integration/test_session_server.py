"""The session server in front of a real engine process, driven by the official `openai` client:
plain and streaming calls, a 3-turn episode with a tool call and a tool message, the session's
Sample checked against what the engine returned, and OpenAI's 404 for an unknown session."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from miles.agentic.session_server import SessionServer
from miles.engine.process import start_engine
from miles.rollout.client import SGLangClient
from miles.sample import Status

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
# the random tiny model calls the tool only when constrained to (SGLang's `regex` extension)
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOL_REGEX = TOOL_CALL.replace("{", r"\{").replace("}", r"\}")


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("sessions") / "engine.log")
    yield proc
    proc.stop()


def run_with_server(engine, tiny_model, scenario):
    """Run `scenario(server)` against a started session server in a fresh event loop."""

    async def main():
        client = SGLangClient(engine.url)
        server = SessionServer([client], tiny_model, max_new_tokens=12)
        await server.start()
        try:
            return await scenario(server)
        finally:
            await server.stop()
            await client.aclose()

    return asyncio.run(main())


async def _episode(server: SessionServer):
    sid, base_url = server.open_session({"group_id": 5})
    oai = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    greedy = dict(model="tiny", temperature=0.0, max_tokens=12)
    messages = [{"role": "system", "content": "add numbers"}, {"role": "user", "content": "what is 1 plus 2"}]
    # turn 1: plain, with tools offered and the tool call forced
    first = await oai.chat.completions.create(
        messages=messages,
        tools=TOOLS,
        extra_body={"regex": TOOL_REGEX, "return_token_ids": True},
        **{**greedy, "max_tokens": 96},
    )
    choice = first.choices[0]
    call = choice.message.tool_calls[0]
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "3"})
    # turn 2: streamed
    stream = await oai.chat.completions.create(
        messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}, **greedy
    )
    chunks = [c async for c in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages.append({"role": "assistant", "content": streamed})
    messages.append({"role": "user", "content": "thanks"})
    # turn 3: plain again
    third = await oai.chat.completions.create(
        messages=messages, tools=TOOLS, extra_body={"return_token_ids": True}, **greedy
    )
    tree = (await httpx.AsyncClient().get(f"{server.url}/sessions/{sid}")).json()
    samples = server.close_session(sid)
    await oai.close()
    return first, chunks, third, tree, samples


def test_three_turn_episode_with_a_tool(engine, tiny_model):
    first, chunks, third, tree, samples = run_with_server(engine, tiny_model, _episode)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}

    # the stream: a role chunk first, a finish reason, then the usage chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    assert [n["parent"] for n in tree["nodes"]] == [None, 0, 1]  # one branch, no fork
    (sample,) = samples
    t1, t3 = first.choices[0], third.choices[0]
    assert sample.prompt_ids == t1.prompt_token_ids
    assert sample.tokens == t3.prompt_token_ids + t3.response_token_ids
    # the record holds exactly the engine's tokens, each call's prompt extends the previous tokens
    r1 = t1.response_token_ids
    assert sample.response_ids[: len(r1)] == r1 and sample.loss_mask[: len(r1)] == [1] * len(r1)
    assert t3.prompt_token_ids[: len(t1.prompt_token_ids) + len(r1)] == t1.prompt_token_ids + r1
    r3 = t3.response_token_ids
    assert sample.response_ids[-len(r3) :] == r3 and sample.loss_mask[-len(r3) :] == [1] * len(r3)
    # mask 1 exactly on the three replies, 0 on the tool message, the user turn and template tokens
    n_reply2 = chunks[-1].usage.completion_tokens
    assert sum(sample.loss_mask) == len(r1) + n_reply2 + len(r3)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m == 0)
    assert all(
        lp < 0.0 or lp == lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m
    )
    assert len(sample.weight_versions) == len(sample.response_ids)
    assert sample.group_id == 5 and sample.status in (Status.COMPLETED, Status.TRUNCATED)


def test_recorded_reply_is_what_the_engine_generates(engine, tiny_model):
    """A streamed reply's recorded tokens equal a direct greedy /generate on the same prompt."""

    async def scenario(server: SessionServer):
        sid, base_url = server.open_session()
        oai = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
        stream = await oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "count to 5"}],
            stream=True,
            temperature=0.0,
            max_tokens=8,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        (sample,) = server.close_session(sid)
        direct = await server.clients[0].generate(
            sample.prompt_ids,
            {"temperature": 0.0, "max_new_tokens": 8, "stop_token_ids": [server.template.turn_end_id]},
        )
        await oai.close()
        return text, sample, direct

    text, sample, direct = run_with_server(engine, tiny_model, scenario)
    assert sample.response_ids == direct.output_ids
    assert sample.loss_mask == [1] * len(direct.output_ids)
    assert sample.rollout_logprobs == pytest.approx(direct.logprobs, abs=1e-4)
    assert text == direct.text


def test_unknown_session_is_openai_404(engine, tiny_model):
    async def scenario(server: SessionServer):
        oai = openai.AsyncOpenAI(base_url=server.base_url("nope"), api_key="unused")
        with pytest.raises(openai.NotFoundError) as err:
            await oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        await oai.close()
        async with httpx.AsyncClient() as http:
            closed = await http.delete(f"{server.url}/sessions/nope")
            bad = await http.post(
                server.base_url(server.open_session()[0]) + "/chat/completions", json={"messages": []}
            )
        return err.value, closed, bad

    err, closed, bad = run_with_server(engine, tiny_model, scenario)
    assert err.status_code == 404 and err.body["code"] == "session_not_found"
    assert closed.status_code == 404 and set(closed.json()["error"]) == {"message", "type", "param", "code"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_delete_returns_the_samples(engine, tiny_model):
    async def scenario(server: SessionServer):
        async with httpx.AsyncClient() as http:
            opened = (await http.post(f"{server.url}/sessions", json={"metadata": {"task": "t1"}})).json()
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
            reply = (await http.post(opened["base_url"] + "/chat/completions", json=body)).json()
            closed = (await http.delete(f"{server.url}/sessions/{opened['id']}")).json()
        return opened, reply, closed

    opened, reply, closed = run_with_server(engine, tiny_model, scenario)
    assert opened["base_url"].endswith(f"/sessions/{opened['id']}/v1")
    assert len(reply["choices"]) == 2
    samples = closed["samples"]
    assert len(samples) == 2  # n=2: two sibling replies, two branches sharing the prompt
    assert samples[0]["prompt_ids"] == samples[1]["prompt_ids"]
    assert all(
        s["metadata"]["task"] == "t1" and s["loss_mask"] == [1] * len(s["response_ids"]) for s in samples
    )


def test_each_session_carries_its_routing_key(tiny_model):
    """Every engine call of a session carries the session id in the router's routing-key header
    (an HTTP server standing in for the router records the headers it gets)."""
    from aiohttp import web

    from miles.rollout.router import ROUTING_KEY_HEADER

    seen: list[str | None] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append(request.headers.get(ROUTING_KEY_HEADER))
        meta = {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.1, 2, None]],
            "weight_version": "1",
        }
        return web.json_response({"text": "", "output_ids": [2], "meta_info": meta})

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        client = SGLangClient(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        server = SessionServer([client], tiny_model)
        await server.start()
        sids = []
        async with httpx.AsyncClient() as http:
            for _ in range(2):
                sid, base_url = server.open_session()
                sids.append(sid)
                history = [{"role": "user", "content": "hi"}]
                for _ in range(2):
                    reply = (
                        await http.post(base_url + "/chat/completions", json={"messages": history})
                    ).json()
                    history += [reply["choices"][0]["message"], {"role": "user", "content": "more"}]
        samples = server.close_session(sids[0])
        await server.stop()
        await client.aclose()
        await runner.cleanup()
        return sids, samples

    sids, samples = asyncio.run(main())
    assert seen == [sids[0], sids[0], sids[1], sids[1]]
    (sample,) = samples
    assert sample.weight_versions == [1] * len(sample.response_ids)


def test_server_leaves_the_process_signal_handlers_alone(tiny_model):
    """In-process, the session server must not take SIGINT/SIGTERM from the process it runs in."""
    import signal

    def mine(signum, frame):
        raise AssertionError("not called")

    async def main():
        server = SessionServer([SGLangClient("http://127.0.0.1:9")], tiny_model)
        await server.start()
        during = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        async with httpx.AsyncClient() as http:  # it serves meanwhile
            models = await http.get(f"{server.base_url(server.open_session()[0])}/models")
        await server.stop()
        return during, models

    before = signal.signal(signal.SIGTERM, mine), signal.getsignal(signal.SIGINT)
    try:
        during, models = asyncio.run(main())
        after = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, before[0])
    assert during[0] is mine and after == (mine, before[1])
    assert "handle_exit" not in repr(during[1])  # SIGINT stays asyncio.run's, not uvicorn's
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_sub_agent_sessions_close_with_their_parent(engine, tiny_model):
    """POST {base_url}/subagents opens a child session; closing the parent returns both sessions'
    samples (parent first) and closes the child; a sub-agent of an unknown session is a 404."""

    async def scenario(server: SessionServer):
        sid, base_url = server.open_session({"group_id": 1})
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with httpx.AsyncClient() as http:
            child = (await http.post(f"{base_url}/subagents", json={"metadata": {"role": "solver"}})).json()
            grandchild = (await http.post(f"{child['base_url']}/subagents")).json()
            for url in (base_url, child["base_url"], grandchild["base_url"]):
                assert (await http.post(f"{url}/chat/completions", json=body)).status_code == 200
            missing = await http.post(f"{server.base_url('nope')}/subagents")
        samples = server.close_session(sid)
        return child, grandchild, samples, missing, dict(server.sessions)

    child, grandchild, samples, missing, left = run_with_server(engine, tiny_model, scenario)
    assert child["base_url"].endswith(f"/sessions/{child['id']}/v1") and child["id"] != grandchild["id"]
    assert len(samples) == 3 and samples[0].metadata.get("parent") is None
    assert samples[1].metadata["parent"] != samples[2].metadata["parent"]
    assert samples[1].metadata["role"] == "solver"
    assert missing.status_code == 404 and not left
