"""The Sandbox protocol: an isolated, disposable place where an episode's tools run commands.

A sandbox is made per episode and used as an async context manager:

    async with BwrapSandbox(settings) as sb:          # create() on enter, close() on exit
        await sb.write_file("task.py", "print(6 * 7)")
        result = await sb.exec(["python3", "task.py"], timeout_s=5)

Contract of every backend:
- `create()` gives a fresh, empty, writable working directory that no other sandbox shares; it
  raises `SandboxStartError` (with a short `reason`) when the sandbox cannot start.
- `exec()` never raises for what the command does: a non-zero exit, a crash, a limit hit or a
  timeout all come back in `ExecResult`; the process and all its children are gone when it returns,
  also when the awaiting task is cancelled.
- `write_file` / `read_file` take paths relative to the working directory and refuse any path that
  leaves it (`..`, absolute paths, symlinks pointing out).
- `close()` stops every process and wipes the working directory; it is idempotent, and it also runs
  from a finalizer when a sandbox is dropped without being closed (a crashed episode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class SandboxError(Exception):
    """A sandbox was used wrongly (closed, path outside it, ...)."""


class SandboxStartError(SandboxError):
    """A sandbox could not start; `reason` is a short counter key (e.g. `bwrap_failed`, `no_space`)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"sandbox failed to start ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """Resource limits of every command run in a sandbox."""

    cpu_s: int = 10
    """CPU seconds per command (RLIMIT_CPU; SIGXCPU then SIGKILL)."""
    mem_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS: allocations beyond it fail)."""
    nproc: int = 64
    """Processes and threads inside the sandbox (RLIMIT_NPROC counted in the sandbox's own user namespace)."""
    fsize_mb: int = 64
    """Largest file a command may write, in MiB (RLIMIT_FSIZE)."""
    nofile: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    wall_s: float = 30.0
    """Default wall-clock limit of one exec (its `timeout_s` overrides it)."""
    output_bytes: int = 1 << 20
    """Bytes of stdout and of stderr kept per exec (the rest is read and dropped)."""


@dataclass
class ExecResult:
    """What one command did."""

    returncode: int
    """Exit status; 128 + N when killed by signal N inside, negative when the runner killed it."""
    stdout: str
    stderr: str
    timed_out: bool = False
    """It ran past its wall-clock limit and was killed."""
    killed_reason: str | None = None
    """Why it was stopped, when it was: `wall_time`, `cpu_time`, `memory`, `file_size`, `signal`."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.killed_reason is None


@runtime_checkable
class Sandbox(Protocol):
    """An isolated working directory with a command runner; see the module docstring for the contract."""

    async def create(self) -> None: ...

    async def exec(
        self, cmd: str | list[str], timeout_s: float | None = None, stdin: bytes | str | None = None
    ) -> ExecResult:
        """Run `cmd` (a list: argv; a string: `/bin/sh -c cmd`) in the working directory."""
        ...

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, *exc: object) -> None: ...
