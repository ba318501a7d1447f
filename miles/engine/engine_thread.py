"""The engine thread's life around the scheduler's steps: taking work in, running administrative
calls between steps, surviving a failing step, dying visibly, and telling /health the truth.

HTTP handlers never touch the batch: they append to an inbox (thread-safe deque) and wait on a
Future; administrative operations (pause, weight updates, flush, memory release) are handed to the
engine thread, which runs them between two steps under the step lock. One thread runs every torch
kernel (on CPU, the KV memory too is allocated by the engine thread, at its first step). Each thread
that runs a parallel CPU kernel gets its own OpenMP thread pool; with more pool threads than cores,
every pool's workers go to sleep between kernels, and decode steps of a tiny model became ~1.5x
slower (8 -> 12 ms at batch 64 on 2 cores) once one weight copy had run on an HTTP worker thread.

Failures. A step that raises fails the requests of its batch with SGLang's FINISH_ABORT carrying
`status_code` 500 and the error (the HTTP layer answers 500 with that message), is logged with its
traceback, and the thread goes on with fresh KV bookkeeping; requests still waiting are kept.
`max_step_failures` failing steps in a row, or an exception outside a step, end the thread: it
records why in `failure`, fails every request it holds, and from then on `submit` fails requests at
once. `health_problem()` names a dead or stopped thread, and a stuck one: work waiting (requests,
or calls) while no loop turn has finished for `stuck_timeout_s`.

Fault injection (tests; `--enable-fault-injection` on the engine): `inject_fault` arms one fault.
`step_error`: the next step that holds requests raises as a bug would. `step_hang`: that step
sleeps for the given seconds (a stuck step). `scheduler_death`: the thread raises out of its loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from miles.engine.request import Request, abort_reason

log = logging.getLogger(__name__)

T = TypeVar("T")
FAULT_KINDS = ("step_error", "step_hang", "scheduler_death")


class InjectedFault(RuntimeError):
    """Raised by an injected fault, where a bug would raise."""


class EngineThread:
    """The loop and its bookkeeping; the scheduler (the subclass) supplies the step and the batch.

    Hooks the subclass implements: `step()` (one engine step, False when idle), `_drain_inbox()`
    (inbox and aborts into the batch), `_land()` (record a step in flight), `_num_requests()`,
    `_drop_batch()` (take the batch's requests out, reset the KV bookkeeping, return them) and `_abort_all(message, status_code)`.
    """

    def __init__(self, stuck_timeout_s: float, max_step_failures: int):
        self.stuck_timeout_s = stuck_timeout_s
        """Work waiting and no loop turn finished for this long: the thread is reported stuck."""
        self.max_step_failures = max_step_failures
        """This many failing steps in a row end the thread (a broken device fails every step)."""
        self.failure: str | None = None
        """Why the engine thread died; None while it runs and after a clean stop."""
        self.num_failed_steps = 0
        self.lock = threading.Lock()
        self.paused = False
        self.released = False
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str | None] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._calls_lock = threading.Lock()
        self._engine_thread: threading.Thread | None = None
        self._phase = "not started"  # -> "running" -> "stopped"
        self._beat_s = time.monotonic()
        self._faults: deque[tuple[str, float]] = deque()

    # ---- called from other threads ----
    def submit(self, req: Request) -> None:
        self._inbox.append(req)
        self._wake.set()
        if self._phase == "stopped":  # nobody will take it: fail it now rather than leave it waiting
            self._fail_inbox()

    def abort(self, rid: str | None) -> None:
        """Abort one request by rid, or all requests when rid is None."""
        self._aborts.append(rid)
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Arm one fault (module docstring); for tests only."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        self._faults.append((kind, seconds))
        self._wake.set()

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (dead, stopped or stuck thread), or None when it can."""
        if self.failure is not None:
            return f"the engine thread died ({self.failure}); see the engine log and restart the engine"
        if self._phase != "running":
            return f"the engine thread is {self._phase}"
        pending = len(self._inbox) + len(self._calls)
        if not (self.paused or self.released):
            pending += self._num_requests()
        idle_s = time.monotonic() - self._beat_s
        if pending and idle_s > self.stuck_timeout_s:
            return (
                f"the engine thread is stuck: no loop turn finished for {idle_s:.0f} s with {pending} "
                f"request(s) or call(s) waiting (stuck_timeout_s={self.stuck_timeout_s:g})"
            )
        return None

    def _on_engine_thread(self, fn: Callable[[], T]) -> T:
        """fn() under the step lock, run by the engine thread between two steps (see the module
        docstring for why), or by the caller when no engine thread runs."""
        with self._calls_lock:
            hand_over = self._engine_thread not in (None, threading.current_thread())
            if hand_over:
                done: Future = Future()
                self._calls.append((fn, done))
        if not hand_over:
            with self.lock:
                return fn()
        self._wake.set()
        return done.result()

    def _run_calls(self) -> None:
        if self._calls:
            self._land()
        while self._calls:
            fn, done = self._calls.popleft()
            try:
                done.set_result(fn())
            except Exception as e:  # the caller's error, raised again in the calling thread
                done.set_exception(e)

    # ---- the engine thread ----
    def run(self) -> None:
        self._engine_thread = threading.current_thread()
        self._phase = "running"
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._beat_s = time.monotonic()
                if self._faults and self._faults[0][0] == "scheduler_death":
                    self._faults.popleft()
                    raise InjectedFault("injected fault: scheduler_death")
                with self.lock:
                    busy = self._turn()
                self._beat_s = time.monotonic()
                if not busy:
                    self._wake.wait(1.0)
        except BaseException as e:
            self.failure = f"{type(e).__name__}: {e}"
            log.exception("the engine thread died; /health now answers 503 and every request fails")
        finally:
            self._shut_down()

    def _turn(self) -> bool:
        """Calls, inbox, one step; a failing step fails its batch and the loop goes on."""
        try:
            self._run_calls()
            self._drain_inbox()
            worked = self._num_requests() > 0 and not (self.paused or self.released)
            busy = not (self.paused or self.released) and self.step()
        except Exception as e:
            self._step_failed(e)
            return True
        if worked:
            self.num_failed_steps = 0
        return busy

    def _fault_point(self) -> None:
        """Where an injected step fault strikes: inside a step that holds requests."""
        if not self._faults or self._faults[0][0] == "scheduler_death":
            return
        kind, seconds = self._faults.popleft()
        if kind == "step_hang":
            time.sleep(seconds)
        else:
            raise InjectedFault(f"injected fault: {kind}")

    def _step_failed(self, exc: Exception) -> None:
        self.num_failed_steps += 1
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        batch = self._drop_batch()
        log.error(
            "%s; failing the %d request(s) of its batch (%d failing step(s) in a row, limit %d)",
            message,
            len(batch),
            self.num_failed_steps,
            self.max_step_failures,
            exc_info=exc,
        )
        reason = abort_reason(message, 500)
        for req in batch:  # a request that had finished before the failure keeps its own reason
            self._finish(req, req.finish or reason)
        if self.num_failed_steps >= self.max_step_failures:
            raise RuntimeError(f"{self.num_failed_steps} engine steps failed in a row; the last: {message}")

    def _shut_down(self) -> None:
        """Leave no caller waiting: finish calls, then fail every request (dead) or abort it (stop)."""
        with self._calls_lock:
            self._engine_thread = None
        self._phase = "stopped"
        with self.lock:
            for part in (self._land, self._run_calls):
                try:
                    part()
                except Exception:
                    log.exception("while stopping the engine thread")
            self._fail_inbox()
            self._drain_inbox()
            if self.failure is not None:
                self._abort_all(f"the engine thread died ({self.failure})", 500)
            else:
                self._abort_all("engine shutting down")

    def _fail_inbox(self) -> None:
        if self.failure is not None:
            reason = abort_reason(f"the engine thread died ({self.failure})", 500)
        else:
            reason = abort_reason("engine shutting down")
        while True:
            try:
                req = self._inbox.popleft()
            except IndexError:
                return
            self._finish(req, reason)

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.finish = reason
        if not req.done.done():
            req.done.set_result(req)

    # ---- hooks (the scheduler's) ----
    def step(self) -> bool:
        raise NotImplementedError

    def _drain_inbox(self) -> None:
        raise NotImplementedError

    def _land(self) -> None:
        raise NotImplementedError

    def _num_requests(self) -> int:
        raise NotImplementedError

    def _drop_batch(self) -> list[Request]:
        raise NotImplementedError

    def _abort_all(self, message: str, status_code: int | None = None) -> None:
        raise NotImplementedError
