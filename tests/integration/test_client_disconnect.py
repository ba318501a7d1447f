"""A client that hangs up frees the engine: requests of a client that disconnects (timed out, stream
closed) are aborted, waiting or running, on the native /generate route, the OpenAI routes and through
the session server; the engine's queue is empty within seconds, not after 1000 tokens each."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from miles.agentic.session_server import SessionServer
from miles.engine.process import start_engine
from miles.rollout.client import SGLangClient

pytestmark = pytest.mark.slow

N, BUDGET = 24, 1000  # more requests than run at once: some wait, some run


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(
        tiny_model,
        device="cpu",
        max_running_requests=8,
        log_path=tmp_path_factory.mktemp("disconnect") / "engine.log",
    )
    yield proc
    proc.stop()


def queued(url: str) -> int:
    state = httpx.get(f"{url}/server_info", timeout=10).json()["internal_states"][0]
    return state["num_running_reqs"] + state["num_waiting_reqs"]


def assert_drains(url: str, within_s: float = 5.0) -> float:
    """The engine has no request left within `within_s` seconds; returns how long that took."""
    start = time.monotonic()
    while (left := queued(url)) > 0:
        assert time.monotonic() - start < within_s, (
            f"{left} requests still queued {within_s} s after the clients left"
        )
        time.sleep(0.1)
    return time.monotonic() - start


async def _give_up(make_call, n: int = N) -> None:
    """Start `n` calls that each give up (a 0.5 s timeout, or a stream closed early) and close their
    connection before the reply is complete."""
    results = await asyncio.gather(*(make_call(i) for i in range(n)), return_exceptions=True)
    assert all(isinstance(r, Exception) for r in results), "a 1000-token call finished in 0.5 s"


def _busy_then(url: str, scenario) -> None:
    asyncio.run(scenario)
    assert_drains(url)
    # the engine is healthy afterwards: a short request is answered at once
    r = httpx.post(
        f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}, timeout=30
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def _long(first: int, **extra) -> dict:
    """A /generate body of BUDGET forced tokens (prompt ids from `first`)."""
    sp = {"max_new_tokens": BUDGET, "ignore_eos": True}
    return {"input_ids": [first, first + 1, first + 2], "sampling_params": sp, **extra}


def test_native_generate_client_that_times_out(engine):
    async def scenario():
        async with httpx.AsyncClient(timeout=0.5) as http:

            async def call(i):
                await http.post(f"{engine.url}/generate", json=_long(1 + 3 * i))

            await _give_up(call)

    _busy_then(engine.url, scenario())


def test_native_stream_closed_after_the_first_chunk(engine):
    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http:

            async def call(i):
                async with http.stream(
                    "POST", f"{engine.url}/generate", json=_long(100 + 3 * i, stream=True)
                ) as r:
                    async for _ in r.aiter_lines():
                        break  # hang up after the first line

            await asyncio.gather(*(call(i) for i in range(N)))

    _busy_then(engine.url, scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_client_that_times_out(engine, stream):
    async def scenario():
        oai = openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused", timeout=0.5, max_retries=0)

        async def call(i):
            out = await oai.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"count to {i}"}],
                max_tokens=BUDGET,
                stream=stream,
                extra_body={"ignore_eos": True},
            )
            if stream:  # chunks keep the read timeout from firing: hang up after the first one
                async for _ in out:
                    break
                await out.close()
                raise ConnectionAbortedError("closed the stream")

        await _give_up(call)
        await oai.close()

    _busy_then(engine.url, scenario())


def test_session_server_agent_that_drops_its_connection(engine, tiny_model):
    async def scenario():
        client = SGLangClient(engine.url)
        server = SessionServer([client], tiny_model, max_new_tokens=BUDGET)
        await server.start()
        try:
            urls = [server.open_session({"group_id": i})[1] for i in range(N)]

            async def call(i):
                oai = openai.AsyncOpenAI(base_url=urls[i], api_key="unused", timeout=0.5, max_retries=0)
                try:
                    await oai.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": f"agent {i}"}],
                        max_tokens=BUDGET,
                        extra_body={"ignore_eos": True},
                    )
                finally:
                    await oai.close()

            await _give_up(call)
            took = await asyncio.to_thread(assert_drains, engine.url)
            assert took < 5.0
        finally:
            await server.stop()
            await client.aclose()

    asyncio.run(scenario())
