"""Start and stop an embedded engine as a child process (for tests, local runs and launchers).

The child is `python -m miles.engine ... --port 0 --url-file F`; we wait for F, then for /health.
If the child exits first, the error carries the tail of its log. `stop()` terminates only the
process we started (terminate, wait, then kill).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from miles.processes import child_options, stop_processes


@dataclass
class EngineProcess:
    """A running engine child: its URL, PID, log file and Popen handle."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_processes([self.proc], timeout_s)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: Path, n_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return "(no log)"


def start_engine(
    model: str | Path,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    max_running_requests: int = 64,
    max_total_tokens: int = 65536,
    seed: int = 0,
    log_path: str | Path | None = None,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 120.0,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> EngineProcess:
    """Launch `python -m miles.engine` on an OS-chosen port and wait until /health answers.

    `env` adds to (or overrides) this process's environment in the child, e.g. CUDA_VISIBLE_DEVICES.
    `cpus` pins the engine to these host cores (set on the child's main thread as soon as it exists,
    before the interpreter has started another thread, so every thread it starts inherits them)."""
    log_file = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="engine-", suffix=".log")[1])
    log_file.parent.mkdir(parents=True, exist_ok=True)
    url_file = log_file.with_name(log_file.name + ".url.json")
    url_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "miles.engine", "--model", str(model), "--host", host, "--port", "0"]
    cmd += ["--device", device, "--max-running-requests", str(max_running_requests)]
    cmd += ["--max-total-tokens", str(max_total_tokens), "--seed", str(seed), "--url-file", str(url_file)]
    cmd += ["--dtype", dtype] if dtype else []
    cmd += extra_args or []
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            **child_options(),
        )
    engine = EngineProcess(url="", proc=proc, log_path=log_file)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {proc.returncode}; log {log_file}:\n{log_tail(log_file)}"
                )
            if url_file.exists():
                engine.url = json.loads(url_file.read_text())["url"]
                if httpx.get(engine.url + "/health", timeout=5).status_code == 200:
                    return engine
            time.sleep(0.1)
        raise TimeoutError(
            f"engine not healthy after {startup_timeout_s} s; log {log_file}:\n{log_tail(log_file)}"
        )
    except BaseException:
        engine.stop()
        raise
