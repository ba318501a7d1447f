"""A pool of per-episode sandboxes: bounded concurrency, start-ahead, retry-then-drop on start failure.

    pool = SandboxPool(lambda: BwrapSandbox(settings), max_live=16, start_ahead=4)
    async with pool.acquire() as sb:        # a created sandbox, ready to exec
        ...                                 # closed (and wiped) on exit; never reused
    await pool.close()

- At most `max_live` sandboxes exist at once (those handed out plus those started ahead); `acquire`
  waits for a slot.
- `start_ahead` sandboxes are created in the background so an episode rarely waits for a start; a
  sandbox is used by one episode only, so the pool refills after each hand-out.
- A start that fails (`SandboxStartError`, or any exception from `create`) is retried `retries`
  times; then `acquire` raises `SandboxStartError` and the episode is dropped. Every failure is
  counted by reason in `stats()` (`failures`), and so are drops (`dropped`), along with start times.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from miles.agentic.sandbox.base import Sandbox, SandboxStartError


class SandboxPool:
    """See the module docstring."""

    def __init__(
        self,
        factory: Callable[[], Sandbox],
        max_live: int = 8,
        start_ahead: int = 0,
        retries: int = 2,
        retry_delay_s: float = 0.05,
    ) -> None:
        if max_live < 1 or not 0 <= start_ahead <= max_live or retries < 0:
            raise ValueError("sandbox pool: max_live >= 1, 0 <= start_ahead <= max_live, retries >= 0 please")
        self.factory, self.max_live, self.start_ahead = factory, max_live, start_ahead
        self.retries, self.retry_delay_s = retries, retry_delay_s
        self.failures: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.start_times_s: list[float] = []
        self.handed_out = 0
        self._live = 0
        self._changed: asyncio.Condition | None = None
        self._ready: list[Sandbox] = []
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> SandboxPool:
        """Begin starting sandboxes ahead (optional: acquire does it too)."""
        self._refill()
        return self

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Sandbox]:
        """A started sandbox for one episode, closed on exit whatever happens inside."""
        if self._closed:
            raise RuntimeError("the sandbox pool is closed")
        changed = self._condition()
        self._refill()
        async with changed:  # a ready sandbox already holds its slot; else wait for a free slot
            await changed.wait_for(lambda: bool(self._ready) or self._live < self.max_live)
            sandbox = self._ready.pop(0) if self._ready else None
            self._live += sandbox is None
        if sandbox is None:
            try:
                sandbox = await self._start_with_retries()
            except BaseException:
                await self._release()
                raise
        self.handed_out += 1
        self._refill()
        try:
            yield sandbox
        finally:
            try:
                await sandbox.close()
            finally:
                await self._release()

    def _condition(self) -> asyncio.Condition:
        """Made on first use inside the running loop (constructors do not touch the loop)."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _release(self) -> None:
        changed = self._condition()
        async with changed:
            self._live -= 1
            changed.notify_all()
        self._refill()

    async def _start_with_retries(self) -> Sandbox:
        last: SandboxStartError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_delay_s * attempt)
            sandbox = self.factory()
            t0 = time.perf_counter()
            try:
                await sandbox.create()
            except Exception as e:
                last = e if isinstance(e, SandboxStartError) else SandboxStartError(type(e).__name__, str(e))
                self.failures[last.reason] += 1
                with contextlib.suppress(Exception):
                    await sandbox.close()
                continue
            self.start_times_s.append(time.perf_counter() - t0)
            return sandbox
        assert last is not None
        self.dropped[last.reason] += 1
        raise SandboxStartError(last.reason, f"gave up after {self.retries + 1} attempts: {last.detail}")

    def _refill(self) -> None:
        """Start sandboxes in the background until `start_ahead` are ready or starting (slots allowing)."""
        while (
            not self._closed
            and len(self._ready) + len(self._starting) < self.start_ahead
            and self._live < self.max_live
        ):
            self._live += 1
            task = asyncio.ensure_future(self._start_ahead_one())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_ahead_one(self) -> None:
        try:
            sandbox = await self._start_with_retries()
        except BaseException:  # counted in failures/dropped (or the pool closed); acquire retries itself
            await self._release()
            return
        if self._closed:
            await sandbox.close()
            await self._release()
            return
        changed = self._condition()
        async with changed:
            self._ready.append(sandbox)
            changed.notify_all()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: starts, start time p50, failures and drops by reason."""
        times = sorted(self.start_times_s)
        return {
            "starts": len(times),
            "start_p50_s": times[len(times) // 2] if times else 0.0,
            "handed_out": self.handed_out,
            "failures": dict(self.failures),
            "dropped": dict(self.dropped),
        }

    async def close(self) -> None:
        """Stop starting, close every ready sandbox; sandboxes in use close when their episode ends."""
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        while self._ready:
            await self._ready.pop().close()
            await self._release()
