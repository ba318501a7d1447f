"""Rendezvous through the run directory on the shared filesystem, plus job-id-derived ports.

Engines publish `{"url", "pid", "node", "incarnation"}` as RUN_DIR/rendezvous/engines/<name>.json
(temporary file + rename, so a reader never sees half a record); the eval group's engines
(`eval.mode: dedicated` under Slurm) publish the same records in RUN_DIR/rendezvous/eval_engines/. `incarnation` is
JobEnvironment.incarnation (`<job id>.<restart count>` under Slurm, a per-start id under `miles
train`): records of any other start (a requeue on other nodes, an earlier job on the same run
directory) are stale, reported and ignored. `read_engines`/`read_router` are the only readers.
The trainer's master address is the first node of the actor group; its port is derived from the job
id, so no port is published.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000


ENGINES = "engines"
"""Folder of the rollout engines' records."""
EVAL_ENGINES = "eval_engines"
"""Folder of the eval group's engines' records (read by miles.eval.runner)."""
TEACHERS = "teachers"
"""Folder of the distillation teacher engines' records (train.distill.teacher_model)."""


def engines_dir(run_dir: str | Path, folder: str = ENGINES) -> Path:
    return Path(run_dir) / "rendezvous" / folder


def write_atomic(path: Path, data: Any, *, indent: int | None = None, durable: bool = False) -> None:
    """Write JSON so that readers see the old file or the whole new one; `durable`: on disk (fsynced)
    before it replaces the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=indent)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def publish_router(run_dir: str | Path, url: str, pid: int, incarnation: str) -> Path:
    """Publish the router in front of this incarnation's engines."""
    path = Path(run_dir) / "rendezvous" / "router.json"
    write_atomic(path, {"url": url, "pid": pid, "incarnation": incarnation})
    return path


def publish_engine(
    run_dir: str | Path, name: str, url: str, pid: int, node: str, incarnation: str, folder: str = ENGINES
) -> Path:
    """Publish one engine's URL for this incarnation of the job (in `folder`: ENGINES or EVAL_ENGINES)."""
    path = engines_dir(run_dir, folder) / f"{name}.json"
    write_atomic(path, {"url": url, "pid": pid, "node": node, "incarnation": incarnation})
    return path


def _read_records(paths: list[Path], incarnation: str) -> list[dict[str, Any]]:
    """Records of `incarnation` among `paths`; records of other incarnations (or unreadable ones) are
    stale: left in place for the post-mortem, reported once each, never used."""
    out = []
    for path in paths:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            _report_stale(path, f"unreadable ({e})")
            continue
        if rec.get("incarnation") == incarnation:
            out.append(rec)
        else:
            _report_stale(path, f"incarnation {rec.get('incarnation')!r}, this one is {incarnation!r}")
    return out


_REPORTED: set[tuple[str, str]] = set()


def _report_stale(path: Path, why: str) -> None:
    if (str(path), why) not in _REPORTED:
        _REPORTED.add((str(path), why))
        log.warning("ignoring stale rendezvous record %s: %s", path, why)


def read_engines(run_dir: str | Path, incarnation: str, folder: str = ENGINES) -> list[dict[str, Any]]:
    """Engine records of this incarnation in `folder`, sorted by file name (the one reader of them)."""
    return _read_records(sorted(engines_dir(run_dir, folder).glob("*.json")), incarnation)


def read_router(run_dir: str | Path, incarnation: str) -> str | None:
    """The router's URL when one of this incarnation is published, else None."""
    recs = _read_records(
        [p for p in [Path(run_dir) / "rendezvous" / "router.json"] if p.exists()], incarnation
    )
    return recs[0]["url"] if recs else None


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_engines(
    run_dir: str | Path, n: int, timeout_s: float, incarnation: str, poll_s: float = 0.5
) -> list[str]:
    """URLs of `n` published engines once each answers /health; TimeoutError naming what is missing."""
    deadline = time.monotonic() + timeout_s
    urls: list[str] = []
    while time.monotonic() < deadline:
        urls = [r["url"] for r in read_engines(run_dir, incarnation)]
        if len(urls) >= n and all(healthy(u) for u in urls):
            return urls
        time.sleep(poll_s)
    raise TimeoutError(
        f"{len(urls)} of {n} engines published in {engines_dir(run_dir)} after {timeout_s:.0f}s "
        f"(healthy: {sum(healthy(u) for u in urls)}); see {Path(run_dir) / 'logs'} and raise "
        "engine.startup_timeout_s if they are still loading"
    )


def master_port(job_id: str | int) -> int:
    """Trainer rendezvous port of a job: stable for the job (and its requeues), distinct across jobs."""
    return MASTER_PORT_BASE + int(str(job_id).split("_")[0]) % MASTER_PORT_SPAN


def node_address(name: str) -> str:
    """IP address of a Slurm node: DNS first, else the NodeAddr Slurm knows (one-host dev clusters)."""
    try:
        return socket.gethostbyname(name)
    except OSError:
        pass
    out = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True, check=True)
    for word in out.stdout.split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    raise RuntimeError(f"node {name!r} has no address in DNS nor in `scontrol show node`")
