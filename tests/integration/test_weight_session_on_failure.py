"""A push whose weight-update session cannot open on one engine (it died) ends the session it opened
on the others, so that the push after the repair can open one again (real engine processes)."""

from __future__ import annotations

import asyncio

import pytest

from miles.engine.process import start_engine
from miles.rollout.client import SGLangClient
from miles.weights.transport import push_paused


def test_a_dead_engine_does_not_leave_the_live_ones_session_open(tiny_model, tmp_path) -> None:
    live = start_engine(tiny_model, device="cpu", log_path=tmp_path / "live.log")
    dead = start_engine(tiny_model, device="cpu", log_path=tmp_path / "dead.log")
    dead_url = dead.url
    dead.stop()
    sent = []

    async def send(bucket, version):
        sent.append(version)

    async def go():
        clients = [SGLangClient(live.url), SGLangClient(dead_url, retries=0, connect_timeout_s=2.0)]
        try:
            with pytest.raises(Exception):  # noqa: B017 - whatever the dead engine's error is
                await push_paused(clients, None, [[]], "1", send)
            # the live engine's session was ended: a new push opens one and completes
            await push_paused(clients[:1], None, [[]], "2", send)
        finally:
            for c in clients:
                await c.aclose()

    try:
        asyncio.run(go())
    finally:
        live.stop()
    assert sent == ["2"]
