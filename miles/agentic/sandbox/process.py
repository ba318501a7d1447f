"""Run one isolated command to completion in a thread of its own: capped output, wall-time kill, and a
stop that the awaiting coroutine can trigger.

Why a thread and not asyncio's subprocess API: a task cancelled inside
`asyncio.create_subprocess_exec` (as `asyncio.run` does with the tasks left when an episode crashes)
can wait forever in CPython 3.11 for pipes that never connected. Here the coroutine only awaits a
future; on cancellation it sets `stop`, the thread kills the command's process group within
`POLL_S` and finishes by itself. One thread per running command, so execs never queue behind a
shared executor.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

POLL_S = 0.05
"""How often the thread looks at `stop` while the command runs."""


@dataclass
class Finished:
    """What the command did, before interpretation."""

    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool


def kill_group(pgid: int) -> None:
    """SIGKILL a process group, ignoring one that is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group `pgid`. bwrap's inner process
    can outlive the outer one as a zombie until the host's init reaps it; that counts as gone."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def run(
    argv: list[str],
    stdin: bytes | None,
    timeout_s: float,
    cap: int,
    stop: threading.Event,
    started: Callable[[int], None],
    ended: Callable[[int], None],
    user: int | None,
) -> Finished:
    """Start `argv` in a new session (as `user` when given), feed `stdin`, keep `cap` bytes of each
    output, kill the group at `timeout_s` or when `stop` is set; `started(pid)` / `ended(pid)` bracket
    the time the process group may be signalled. Blocking: call it in a thread."""
    ids = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={"PATH": os.defpath},
        **ids,
    )
    started(proc.pid)
    try:
        out, err, timed_out = _pump(proc, stdin, time.monotonic() + timeout_s, cap, stop)
    finally:
        kill_group(proc.pid)
        ended(proc.pid)  # before the reap, so nobody signals a recycled pid
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    return Finished(proc.returncode, out, err, timed_out)


def _pump(
    proc: subprocess.Popen, stdin: bytes | None, deadline: float, cap: int, stop: threading.Event
) -> tuple[bytes, bytes, bool]:
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    pending = memoryview(stdin or b"")
    with selectors.DefaultSelector() as sel:
        for stream in kept:
            sel.register(stream, selectors.EVENT_READ)
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0 or stop.is_set():
                kill_group(proc.pid)
                return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), left <= 0
            for key, _ in sel.select(min(POLL_S, left)):
                if key.fileobj is proc.stdin:
                    pending = _write_some(sel, proc.stdin, pending)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.fileobj]
                buf += chunk[: max(0, cap - len(buf))]
    while proc.poll() is None:  # outputs closed, process not yet reaped
        if time.monotonic() >= deadline or stop.is_set():
            return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), time.monotonic() >= deadline
        time.sleep(0.005)
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), False


def _write_some(sel: selectors.BaseSelector, pipe, pending: memoryview) -> memoryview:
    try:
        n = os.write(pipe.fileno(), pending[: 1 << 16]) if pending else 0
    except BlockingIOError:
        n = 0
    except (BrokenPipeError, ConnectionResetError):  # the command does not read its input
        n, pending = 0, memoryview(b"")
    pending = pending[n:]
    if not pending:
        sel.unregister(pipe)
        pipe.close()
    return pending


async def run_in_thread(
    argv: list[str],
    stdin: bytes | None,
    timeout_s: float,
    cap: int,
    started: Callable[[int], None],
    ended: Callable[[int], None],
    user: int | None,
) -> Finished:
    """`run` in a thread of its own; cancelling the await stops the command (see the module docstring)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Finished] = loop.create_future()
    stop = threading.Event()

    def deliver(setter: Callable, value: object) -> None:
        if not future.done():
            setter(value)

    def target() -> None:
        try:
            result = run(argv, stdin, timeout_s, cap, stop, started, ended, user)
        except BaseException as e:  # handed to the awaiting coroutine
            outcome: tuple[Callable, object] = (future.set_exception, e)
        else:
            outcome = (future.set_result, result)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=target, name="sandbox-exec", daemon=True).start()
    try:
        return await future
    except asyncio.CancelledError:
        stop.set()
        raise
