"""The WeightTransport seam: how a new version of the trainer's weights reaches every live engine.

Contract (all implementations):
- The trainer's rank 0 calls `setup()` once, then `push(buckets, version)` after each update
  interval, and `close()` at the end. Other trainer ranks never call a transport.
- `buckets` is an iterator of buckets, each a list of (hf_name, full tensor) pairs, no bucket over
  the configured byte size except a single tensor larger than it. Names are HF names of the
  engine's model; tensors are whole (already gathered), on any device.
- `push` pauses generation on every engine with the transport's pause mode (`abort`, `retract`,
  `in_place`, or None for no pause), delivers every tensor to every engine, sets the engines'
  weight version to `version` with the last bucket, and continues generation, even when the
  delivery failed (then it raises after continuing). When it returns, every engine serves the new
  weights and reports `version`.
- Transports must not mutate the tensors they are given, and must keep no reference after `push`.

Engines are reached through `EngineAdmin` (the SGLang client in miles.rollout.client implements
it), so this room does not depend on how HTTP is spoken. Each transport is built from the run's plan
and its `Site` by one lookup in `miles.weights.TRANSPORTS` (`from_plan`), and says whether its push
already checks what the engines stored (`checks_in_push`), so that `weights.check` needs no second export.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

Bucket = list[tuple[str, torch.Tensor]]
PAUSE_MODES = ("abort", "retract", "in_place")


class EngineAdmin(Protocol):
    """The engine calls a transport needs (a subset of SGLang's admin API)."""

    url: str

    async def pause_generation(self, mode: str = "abort") -> None: ...
    async def continue_generation(self) -> None: ...
    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> Any: ...
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = ...,
        backend: str = ...,
    ) -> Any: ...
    async def destroy_weights_update_group(self, group_name: str = ...) -> Any: ...
    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = ...,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> Any: ...
    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list: ...


@dataclass(frozen=True)
class Site:
    """Where a run's transport works: the engines, the run directory, whether every engine is on this
    host (`local`) and the address the trainer's rank 0 is reached at from the engines."""

    engines: Sequence[EngineAdmin]
    run_dir: Path
    local: bool
    address: str


class WeightTransport(Protocol):
    """Push a versioned stream of buckets of named full tensors from trainer rank 0 into every engine."""

    @classmethod
    def from_plan(cls, plan: Any, site: Site) -> WeightTransport: ...

    checks_in_push: bool
    """With `weights.check`, `push` itself compares the bytes each engine stored with what it sent (and
    raises on a difference): every trainer rank then skips the post-push check's second export."""

    async def setup(self) -> None: ...
    async def push(self, buckets: Iterable[Bucket], version: str) -> None: ...
    async def close(self) -> None: ...


def with_last(items: Iterable[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """(bucket, is_last) pairs, reading one bucket ahead so the last one is known when it is sent."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def pause_mode_of(plan: Any) -> str | None:
    """`weights.pause_mode` as the transports take it (None: no pause)."""
    mode = plan.weights.pause_mode
    return None if mode == "none" else mode


def check_pause_mode(mode: str | None) -> None:
    if mode is not None and mode not in PAUSE_MODES:
        raise ValueError(f"unknown pause mode {mode!r}; known: {', '.join(PAUSE_MODES)} or None")


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


async def push_paused(
    engines: Sequence[EngineAdmin],
    pause_mode: str | None,
    buckets: Iterable[Bucket],
    version: str,
    send: Callable[[Bucket, str | None], Awaitable[None]],
) -> None:
    """The push contract around a transport's `send(bucket, version or None)`: pause every engine,
    send each bucket (the last one carries the version), continue even when a send failed."""
    async with paused(engines, pause_mode):
        # an engine that fails to open its session (e.g. it just died) must not leave the others' open:
        # those are ended below, so that the next push (after a repair) can begin again
        began = await asyncio.gather(*(_session(e, "begin") for e in engines), return_exceptions=True)
        opened = [e for e, r in zip(engines, began, strict=True) if not isinstance(r, BaseException)]
        try:
            failed = [r for r in began if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            for bucket, last in with_last(buckets):
                await send(bucket, str(version) if last else None)
        finally:
            await asyncio.gather(*(_session(e, "end") for e in opened), return_exceptions=True)


@contextlib.asynccontextmanager
async def paused(engines: Sequence[EngineAdmin], pause_mode: str | None) -> AsyncIterator[None]:
    """Generation paused on every engine for the block (`pause_mode` None: not paused), and continued
    after it even when the block failed."""
    if pause_mode:
        await asyncio.gather(*(e.pause_generation(pause_mode) for e in engines))
    try:
        yield
    finally:
        if pause_mode:
            await asyncio.gather(*(e.continue_generation() for e in engines))


async def _session(engine: EngineAdmin, which: str) -> None:
    """SGLang's weight-update session (`/begin_weight_update`, `/end_weight_update`): recent SGLang
    loads tensor and distributed updates only inside one; servers without the routes (404) skip it."""
    call = getattr(engine, f"{which}_weight_update", None)
    if call is None:
        return
    try:
        await call()
    except Exception as e:
        if getattr(e, "status", None) != 404:
            raise
