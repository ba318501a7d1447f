"""Start, reconfigure and stop the real `sglang-router` (Rust binary from PyPI) in front of engines.

The router takes its port on the command line, so we ask the OS for a free loopback port, pass it,
and try again with a new port if the router could not bind it. Ready means /health answers and
every initial worker is registered and healthy. Workers are added with POST /workers {"url": ...}
and removed with DELETE /workers/<id> (the router's own ids; looked up by URL here). Requests
already forwarded to a removed worker still finish on that worker, so stop an engine only after
removing it and letting its requests drain. `stop()` ends only the process this module started.

Session affinity: policy `manual` sends every request carrying the same `X-SMG-Routing-Key` header
(ROUTING_KEY_HEADER) to one worker, for as long as that worker is healthy; a new key goes to the
worker holding the fewest keys (`--assignment-mode min_group`), so sessions spread evenly. Requests
without the header are routed at random. sglang-router 0.3's CLI offers no other header-keyed policy.

Registering a worker, the router probes it over HTTP (/health, /server_info, /model_info) and, at the
same time, over gRPC (an HTTP/2 connection preface, once for SGLang and once for vLLM). A uvicorn
server such as SGLang's or the embedded engine's answers each preface with a logged "Invalid HTTP
request received." warning; no router option in 0.3 turns the gRPC probe off.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from miles.processes import child_options, free_port, stop_processes
from miles.serving import ApiKeys

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "manual")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""Header whose value keys a session to one worker under policy `manual`."""


def policy_args(policy: str) -> list[str]:
    """The router's command-line flags of a routing policy (one of POLICIES)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(POLICIES)}")
    return ["--policy", policy] + (["--assignment-mode", "min_group"] if policy == "manual" else [])


def router_binary() -> str:
    """Path of `sglang-router`: next to this interpreter first (virtual envs), else on PATH."""
    local = Path(sys.executable).with_name("sglang-router")
    found = str(local) if local.exists() else shutil.which("sglang-router")
    if not found:
        raise FileNotFoundError("sglang-router is not installed; `pip install sglang-router`")
    return found


@dataclass
class RouterProcess:
    """A running router: its URL, Popen handle and log file."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None = None
    """The router's --api-key (sent with every management call)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def headers(self) -> dict[str, str]:
        return ApiKeys(self.api_key).headers("/workers")

    def workers(self) -> list[dict[str, Any]]:
        resp = httpx.get(self.url + "/workers", timeout=10, headers=self.headers)
        resp.raise_for_status()
        return resp.json().get("workers", [])

    def worker_urls(self) -> list[str]:
        return [w["url"] for w in self.workers()]

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        resp = httpx.post(self.url + "/workers", json={"url": url}, timeout=timeout_s, headers=self.headers)
        if resp.status_code >= 400:
            raise RuntimeError(f"router {self.url}: adding worker {url} failed: {resp.text[:300]}")
        self._wait(lambda: any(w["url"] == url and w.get("is_healthy") for w in self.workers()), timeout_s)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        ids = [w["id"] for w in self.workers() if w["url"] == url]
        if not ids:
            raise ValueError(f"router {self.url} has no worker {url}; known: {self.worker_urls()}")
        for wid in ids:
            resp = httpx.delete(f"{self.url}/workers/{wid}", timeout=timeout_s, headers=self.headers)
            if resp.status_code >= 400:
                raise RuntimeError(f"router {self.url}: removing worker {url} failed: {resp.text[:300]}")
        self._wait(lambda: url not in self.worker_urls(), timeout_s)

    def _wait(self, cond, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {self.url}: condition not met in {timeout_s} s")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_processes([self.proc], timeout_s)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _ready(url: str, n_workers: int, headers: dict[str, str]) -> bool:
    try:
        if httpx.get(url + "/health", timeout=2).status_code != 200:
            return False
        workers = httpx.get(url + "/workers", timeout=2, headers=headers).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return False
    return sum(1 for w in workers if w.get("is_healthy")) >= n_workers


def start_router(
    worker_urls: list[str],
    *,
    policy: str = "cache_aware",
    host: str = "127.0.0.1",
    log_path: str | Path | None = None,
    startup_timeout_s: float = 60.0,
    extra_args: list[str] | None = None,
    attempts: int = 3,
    api_key: str | None = None,
) -> RouterProcess:
    """Launch sglang-router on a free port in front of `worker_urls`; wait until it routes to all.

    `api_key`: the router's `--api-key`: it then answers 401 to a call without that Bearer key and
    sends the key to its workers (which must take the same key, miles/serving.py)."""
    flags = policy_args(policy)
    log_file = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="router-", suffix=".log")[1])
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(attempts):
        port = free_port(host)
        cmd = [router_binary(), "launch", "--host", host, "--port", str(port), *flags]
        # the metrics exporter binds a fixed default port (29000) unless told otherwise
        cmd += ["--prometheus-host", host, "--prometheus-port", str(free_port(host))]
        cmd += ["--worker-urls", *worker_urls] if worker_urls else []
        cmd += extra_args or []
        cmd += [f"--api-key={api_key}"] if api_key else []  # `=`: a key may start with "-"
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **child_options()
            )
        router = RouterProcess(url=f"http://{host}:{port}", proc=proc, log_path=log_file, api_key=api_key)
        deadline = time.monotonic() + startup_timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if _ready(router.url, len(worker_urls), router.headers):
                return router
            time.sleep(0.1)
        exited_early = proc.poll() is not None
        router.stop()
        if not exited_early:
            break
        # Exited before ready: most likely the port was taken between our probe and its bind.
    tail = log_file.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"sglang-router did not become ready; log {log_file}:\n{tail}")
