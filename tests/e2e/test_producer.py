"""The producer against a real embedded engine: sample-level backfill, buffer bound, sync fill."""

from __future__ import annotations

import asyncio

import pytest

from miles.config.rollout import RolloutConfig, TaskConfig
from miles.engine.process import start_engine
from miles.rollout.buffer import RolloutBuffer
from miles.rollout.client import SGLangClient
from miles.rollout.generate import Generator, PromptEncoder
from miles.rollout.producer import Producer
from miles.rollout.rewards import first_number
from miles.rollout.tasks import build_task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    with start_engine(
        tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("eng") / "engine.log"
    ) as eng:
        yield eng


def make(engine, tiny_model, capacity: int, slots: int) -> tuple[Producer, RolloutBuffer]:
    cfg = RolloutConfig(max_new_tokens=64)
    task = build_task(TaskConfig(name="longtail", options={"min_tokens": 8, "max_tokens": 64}), seed=0)
    gen = Generator.from_config([SGLangClient(engine.url)], PromptEncoder(tiny_model), first_number, cfg)
    buf = RolloutBuffer(capacity)
    return Producer(gen, task, buf, n_samples=4, max_inflight=slots), buf


def test_async_backfill_keeps_slots_busy_and_buffer_bounded(engine, tiny_model) -> None:
    producer, buf = make(engine, tiny_model, capacity=30, slots=8)

    async def run() -> tuple[list[int], list[int]]:
        stop = asyncio.Event()
        task = asyncio.create_task(producer.run_forever(stop))
        busy, held = [], []
        # the trainer never takes anything: production must stop at capacity. Sample until the buffer
        # is full and then a while longer (a slow host only takes longer to get there)
        full_since = None
        for _ in range(60_000):
            await asyncio.sleep(0.01)
            busy.append(producer.generator.active)
            held.append(len(buf) + producer.inflight_groups)
            if len(buf) >= 30 and full_since is None:
                full_since = len(held)
            if full_since is not None and len(held) - full_since >= 100:
                break
        stop.set()
        await task
        await producer.drain()
        return busy, held

    busy, held = asyncio.run(run())
    assert max(held) <= 30 and len(buf) == 30
    # until the buffer fills up, ~8 requests stay in flight: a finished sample's slot is taken again
    # at once by the next sample, whatever its group (waiting for whole groups would let it drain)
    filling = busy[: next(i for i, h in enumerate(held) if h >= 30)]
    assert len(filling) >= 3 and sum(filling) / len(filling) >= 6, (busy, held)


def test_sync_fill_makes_exactly_the_batch(engine, tiny_model) -> None:
    producer, buf = make(engine, tiny_model, capacity=8, slots=8)
    asyncio.run(producer.fill(3))
    groups = buf.get(3, current_version=0, timeout_s=1)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert producer.next_index == 3 and producer.inflight_groups == 0
    lengths = {s.response_length for g in groups for s in g}
    assert len(lengths) > 1  # the long tail really varies lengths


async def masking_generate(gen, prompt, s, params):
    """A generate function whose even-indexed samples could not be scored (a failed verifier)."""
    s.prompt_ids = gen.encoder.prompt_ids(prompt)
    r = await gen.call_engine(s, s.prompt_ids, params)
    await gen.fill(s, r)
    if s.index % 2 == 0:
        s.metadata["masked"] = "verifier timeout"
    return s


def short_producer(engine, tiny_model, generate_fn: str, buf: RolloutBuffer, **options) -> Producer:
    """A producer of short samples (4-8 tokens) made by `generate_fn` of this module."""
    cfg = RolloutConfig(max_new_tokens=8, generate_fn=f"test_producer:{generate_fn}")
    task = build_task(TaskConfig(name="longtail", options={"min_tokens": 4, "max_tokens": 8}), seed=0)
    gen = Generator.from_config([SGLangClient(engine.url)], PromptEncoder(tiny_model), first_number, cfg)
    return Producer(gen, task, buf, **options)


def test_masked_samples_leave_their_group_and_are_counted(engine, tiny_model) -> None:
    buf = RolloutBuffer(8)
    producer = short_producer(engine, tiny_model, "masking_generate", buf, n_samples=4, max_inflight=8)
    asyncio.run(producer.fill(2))
    groups = buf.get(2, current_version=0, timeout_s=1)
    assert [sorted(s.index for s in g) for g in groups] == [[1, 3], [1, 3]]
    assert producer.stats.take()["rollout/masked_samples"] == 4.0


async def all_masked_generate(gen, prompt, s, params):
    """A generate function none of whose samples can be scored (a verifier that always crashes)."""
    s = await masking_generate(gen, prompt, s, params)
    s.metadata["masked"] = "verifier crashed"
    return s


def test_a_stream_of_fully_masked_groups_stops_the_run_with_the_reason(engine, tiny_model) -> None:
    """Nothing scorable would otherwise loop forever without a step (the sync fill never fills)."""
    producer = short_producer(
        engine,
        tiny_model,
        "all_masked_generate",
        RolloutBuffer(8),
        n_samples=2,
        max_inflight=4,
        max_masked_groups=3,
    )

    async def fill() -> None:
        try:
            await producer.fill(2, timeout_s=120)
        finally:
            await producer.drain()
            for client in producer.generator.clients:
                await client.aclose()

    with pytest.raises(RuntimeError, match=r"last 3 groups had every sample masked \(verifier crashed\)"):
        asyncio.run(fill())
    assert producer.stats.masked >= 6
