"""The rollout client's routing keys through the real sglang-router (policy `manual`) in front of two
embedded engines: every request of one key, sent with `routing_key=` or through a bound
`with_routing_key` view, is served by one engine; different keys spread over both."""

from __future__ import annotations

import asyncio
import zlib

import httpx
import pytest

from miles.engine.process import start_engine
from miles.rollout.client import SGLangClient
from miles.rollout.router import start_router

PROMPT = [5, 6, 7, 8]
PARAMS = {"max_new_tokens": 2, "temperature": 0.0}


def prompt_of(key: str) -> list[int]:
    """A 16-token prompt of its own for each key (so an engine's prefix cache tells who served it)."""
    seed = zlib.crc32(key.encode())
    return [10 + (seed // (j + 1) + 37 * j) % 300 for j in range(16)]


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("routing-key")
    started = []
    try:
        for i in range(2):
            started.append(start_engine(tiny_model, device="cpu", seed=i, log_path=logs / f"engine-{i}.log"))
        yield started
    finally:
        for e in started:
            e.stop()


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    log = tmp_path_factory.mktemp("routing-key") / "router.log"
    with start_router([e.url for e in engines], policy="manual", log_path=log) as r:
        yield r


def _cached(engines) -> list[int]:
    """Tokens in each engine's prefix cache (they grow only when a prompt is served)."""
    return [
        httpx.get(e.url + "/server_info", timeout=10).json()["internal_states"][0]["num_prefix_cached_tokens"]
        for e in engines
    ]


async def _home(client: SGLangClient, engines, key: str, **kw) -> int:
    """Send key's first request alone (the router assigns the key to a worker then); returns the
    index of the engine whose prefix cache took its prompt."""
    before = _cached(engines)
    first = await client.generate(prompt_of(key), PARAMS, **kw)
    assert first.cached_tokens < len(prompt_of(key)) - 1, first.meta_info  # not served before
    grew = [i for i, (a, b) in enumerate(zip(before, _cached(engines), strict=True)) if b > a]
    assert len(grew) == 1, f"the prefix caches of engines {grew} grew for key {key!r}, expected one"
    return grew[0]


def _all_cached(results, key: str) -> None:
    """Every reply found key's prompt cached: each request went to the engine that served the first."""
    for r in results:
        assert r.cached_tokens >= len(prompt_of(key)) - 1, (key, r.meta_info)


def test_one_key_stays_on_one_worker_and_keys_spread(router, engines):
    async def sessions() -> dict[str, int]:
        client = SGLangClient(router.url)
        homes = {}
        try:
            # new keys until both workers hold some (at least four keys): the router can take a worker
            # into its policy a moment after reporting it healthy, so the first keys may all go to one
            for n in range(12):
                if n >= 4 and set(homes.values()) == {0, 1}:
                    break
                key = f"session-{n}"
                view = client.with_routing_key(key)
                homes[key] = await _home(view, engines, key)
                rest = [view.generate(prompt_of(key) + [9 + t], PARAMS) for t in range(6)]
                rest += [client.generate(prompt_of(key), PARAMS, routing_key=key) for _ in range(3)]
                _all_cached(await asyncio.gather(*rest), key)
                await asyncio.sleep(0.5)
        finally:
            await client.aclose()
        return homes

    homes = asyncio.run(sessions())
    if set(homes.values()) != {0, 1}:  # where new keys go is the router's choice, not the client's
        pytest.skip(f"sglang-router put all {len(homes)} keys on one worker: {homes}")


def test_per_request_key_overrides_the_bound_one(router, engines):
    async def run() -> None:
        client = SGLangClient(router.url)
        try:
            homes: dict[str, int] = {}
            for n in range(12):  # two keys that live on different workers
                homes[f"over-{n}"] = await _home(client, engines, f"over-{n}", routing_key=f"over-{n}")
                if set(homes.values()) == {0, 1}:
                    break
            if set(homes.values()) != {0, 1}:  # where new keys go is the router's choice
                pytest.skip(f"sglang-router put all {len(homes)} keys on one worker: {homes}")
            bound = next(k for k, w in homes.items() if w != homes[f"over-{n}"])
            view = client.with_routing_key(bound)
            key = f"over-{n}"
            replies = [view.generate(prompt_of(key), PARAMS, routing_key=key) for _ in range(4)]
            _all_cached(await asyncio.gather(*replies), key)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_views_share_the_connections_and_leave_them_open(router):
    async def use() -> None:
        client = SGLangClient(router.url)
        try:
            view = client.with_routing_key("shared")
            await view.generate(PROMPT, PARAMS)
            assert view._client() is client._client()  # one connection pool for the client and its views
            await view.aclose()  # a view does not close what it shares
            assert not client._client().closed
            assert (await client.generate(PROMPT, PARAMS)).completion_tokens == 2
        finally:
            await client.aclose()

    asyncio.run(use())
    with pytest.raises(ValueError, match="routing key"):
        SGLangClient(router.url).with_routing_key("")
