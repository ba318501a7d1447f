"""Two engine processes behind the real sglang-router; one is removed at run time and nothing is lost."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from miles.engine.process import start_engine
from miles.rollout.client import SGLangClient
from miles.rollout.router import start_router


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    procs = [
        start_engine(tiny_model, device="cpu", seed=i, log_path=logs / f"engine-{i}.log") for i in range(2)
    ]
    yield procs
    for p in procs:
        p.stop()


def test_bad_policy_named():
    with pytest.raises(ValueError, match="round_robin"):
        start_router([], policy="fastest")


@pytest.mark.slow
def test_requests_survive_worker_removal(engines, tmp_path):
    with start_router(
        [e.url for e in engines], policy="round_robin", log_path=tmp_path / "router.log"
    ) as router:
        assert sorted(router.worker_urls()) == sorted(e.url for e in engines)
        client = SGLangClient(router.url)
        params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}

        async def run():
            first = [asyncio.create_task(client.generate([i % 50 + 3, 7, 8], params)) for i in range(24)]
            await asyncio.sleep(0.2)
            await asyncio.to_thread(router.remove_worker, engines[1].url)
            second = [asyncio.create_task(client.generate([i % 50 + 3, 9], params)) for i in range(24)]
            return await asyncio.gather(*first, *second)

        results = asyncio.run(run())
        assert router.worker_urls() == [engines[0].url]
        assert len(results) == 48 and all(
            r.finish_reason == "length" and len(r.output_ids) == 40 for r in results
        )
        assert len({r.meta_info["id"] for r in results}) == 48
        removed_steps = httpx.get(engines[1].url + "/get_server_info").json()["internal_states"][0][
            "num_steps"
        ]
        assert removed_steps > 0, "the removed engine should have served part of the first wave"
        router.add_worker(engines[1].url)
        assert sorted(router.worker_urls()) == sorted(e.url for e in engines)
    assert router.proc.poll() is not None
