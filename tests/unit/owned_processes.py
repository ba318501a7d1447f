"""Helpers of the sandbox tests that look for processes which outlive their owner (not a test module)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable


def pids_running(marker: str) -> list[int]:
    """Processes whose command line contains `marker`."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if marker in f.read().decode(errors="replace"):
                    pids.append(int(p))
        except OSError:
            pass
    return pids


def left_after_owner_killed(code: str, marker: str) -> list[int]:
    """Run `code` in a Python process (it prints one line once its sandbox exists, then runs
    `sleep MARKER` in it), SIGKILL that process as soon as the sleep runs (no close(), no finalizer:
    only the kernel and the sandbox's own arrangements clean up), and return the processes holding
    the marker that are still alive 5 s later (killed, so that a failure leaves nothing behind)."""
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip()
        for _ in range(500):  # until the command itself runs (the runtime's own cmdline holds the marker too)
            if any(_cmdline(p).startswith("sleep\0") for p in pids_running(marker)):
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the sandboxed command never started")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    return left_after(lambda: pids_running(marker))


def left_after(pids: Callable[[], list[int]], wait_s: float = 5.0) -> list[int]:
    """`pids()` once it is empty, or what is left after `wait_s` (killed, so as not to leak)."""
    deadline = time.monotonic() + wait_s
    while (left := pids()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""
