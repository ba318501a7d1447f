"""Child processes with good manners: ports from the OS, stopping exactly the PIDs we started, and
children that never outlive the process that started them.

Every launcher (engines, router, trainer ranks, Slurm job steps) uses these helpers, so there is one
way to stop a child: SIGTERM, a grace period, then SIGKILL for that PID only. `child_options()` gives
a child its own session (a terminal's Ctrl-C reaches only the launcher, which then stops the children
in order) and a Linux parent-death signal (the child is killed even when the launcher is SIGKILLed).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

_PR_SET_PDEATHSIG = 1
_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Have Linux send `sig` to this process when its parent exits, however the parent ends.

    With `parent_pid`, exit at once if the parent is already gone (it died before the request took
    effect). Elsewhere than Linux this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    _libc().prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def child_options(death_signal: int = signal.SIGKILL) -> dict[str, Any]:
    """Popen keyword arguments for a child that must not outlive this process (see the module doc)."""
    if not sys.platform.startswith("linux"):
        return {"start_new_session": True}
    _libc()  # loaded here, in the parent: the child between fork and exec only calls it
    return {
        "start_new_session": True,
        "preexec_fn": functools.partial(die_with_parent, death_signal, os.getpid()),
    }


def stop_processes(procs: Iterable[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Terminate every still-running process, then wait for each; kill those that outlive the grace."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    for p in running:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout_s)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists on this host (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
