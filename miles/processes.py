"""Child processes with good manners: ports from the OS, and stopping exactly the PIDs we started.

Every launcher (engines, router, trainer ranks, Slurm job steps) uses these two helpers, so there is
one way to stop a child: SIGTERM, a grace period, then SIGKILL for that PID only.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterable


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
