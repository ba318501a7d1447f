"""`miles train`'s watch over the processes it started, until the trainer ranks are done.

    every poll: progress bar <- metrics.jsonl
                trainer (torchrun) exited -> its exit code; on failure the console gets the role,
                    the last lines of its error and the log path
                an engine exited, or failed `/health` 3 times in a row -> replaced: stopped, a new
                    one started under the same name (new port, same incarnation), published, swapped
                    in the router; rank 0 of the loop reconnects, pushes the current weights into it
                    and retries the samples that were in flight. More than `engine.max_restarts`
                    replacements of one engine stop the run with its log's last lines.
                a server of engine.urls (not started by us) is never stopped nor replaced: failing
                    /health 3 times in a row is reported once per outage, and the loop waits for it
                    (engine.startup_timeout_s) or goes on with the others
                SIGINT / SIGTERM -> the trainer is asked to checkpoint and stop (RUN_DIR/control/
                    preempt), given `launch.stop_grace_s`; a second signal stops everything at once;
                    exit status 128 + signal number, and one line saying how to resume.

Imports no torch.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.cluster.rendezvous import healthy
from miles.config import Plan
from miles.launch.status import error_excerpt

log = logging.getLogger("miles.launch")

_FAILED_CHECKS = 3


@dataclass
class EngineSlot:
    """One engine of the run: its current process and how often it was replaced."""

    index: int
    proc: Any
    """An EngineProcess (url, pid, alive(), stop(), log_path)."""
    restarts: int = 0
    failed_checks: int = 0
    next_check: float = 0.0
    external: bool = False
    """A server of engine.urls: watched, never restarted or stopped (it is not ours)."""

    @property
    def name(self) -> str:
        return f"engine-{self.index}"


class RunFailed(RuntimeError):
    """A role of the run failed for good; the message is what the console shows."""


@dataclass
class Supervisor:
    """Watches engines and trainer ranks of one local run (see the module docstring)."""

    plan: Plan
    run_dir: Path
    engines: list[EngineSlot]
    restart_engine: Callable[[int], Any]
    """Starts engine i again and publishes it; returns the new EngineProcess."""
    router: Any = None
    interrupted: int | None = None
    deadline: float | None = None
    _last_step: int = field(default=0, init=False)

    def on_signal(self, signum: int, frame: Any) -> None:
        """First signal: ask the loop for a checkpoint and a clean stop; second: stop now."""
        if self.interrupted is not None:
            self.deadline = 0.0
            return
        self.interrupted = signum
        self.deadline = time.monotonic() + self.plan.launch.stop_grace_s
        preempt = self.run_dir / "control" / "preempt"
        preempt.parent.mkdir(parents=True, exist_ok=True)
        preempt.touch()
        name = signal.Signals(signum).name
        print(
            f"\nmiles: {name}: asking the trainer to checkpoint and stop (up to "
            f"{self.plan.launch.stop_grace_s:.0f} s; again to stop now)",
            file=sys.stderr,
        )

    def watch(self, trainers: list[subprocess.Popen], progress: Any = None, poll_s: float = 0.5) -> int:
        """Supervise until every trainer process ended; returns the trainer's exit code."""
        while any(t.poll() is None for t in trainers):
            if any(t.returncode not in (None, 0) for t in trainers):
                break
            if self.deadline is not None and time.monotonic() > self.deadline:
                log.warning("the trainer did not stop within launch.stop_grace_s; stopping it")
                break
            if self.interrupted is None:
                self.check_engines()
            if progress is not None:
                progress()
            time.sleep(poll_s)
        if progress is not None:
            progress()
        return next((t.returncode for t in trainers if t.returncode not in (None, 0)), 0)

    def check_engines(self) -> None:
        """Replace every engine that died or keeps failing its health check."""
        now = time.monotonic()
        for slot in self.engines:
            if slot.external:
                self.check_external(slot, now)
                continue
            if slot.proc.alive() and now >= slot.next_check:
                slot.next_check = now + self.plan.engine.health_check_interval_s
                slot.failed_checks = 0 if healthy(slot.proc.url) else slot.failed_checks + 1
            if not slot.proc.alive():
                self.replace(slot, f"exited with {slot.proc.proc.returncode}")
            elif slot.failed_checks >= _FAILED_CHECKS:
                self.replace(slot, f"failed /health {slot.failed_checks} times in a row")

    def check_external(self, slot: EngineSlot, now: float) -> None:
        """Ask a server of engine.urls for /health; say once per outage that it keeps failing."""
        if now < slot.next_check:
            return
        slot.next_check = now + self.plan.engine.health_check_interval_s
        if healthy(slot.proc.url):
            if slot.failed_checks >= _FAILED_CHECKS:
                print(
                    f"miles: {slot.name} {slot.proc.url} (engine.urls) answers /health again", file=sys.stderr
                )
            slot.failed_checks = 0
            return
        slot.failed_checks += 1
        if slot.failed_checks == _FAILED_CHECKS:
            print(
                f"miles: {slot.name} {slot.proc.url} (engine.urls) failed /health {_FAILED_CHECKS} times in "
                "a row; Miles does not restart servers it did not start: bring it back at the same URL",
                file=sys.stderr,
            )

    def replace(self, slot: EngineSlot, why: str) -> None:
        """Stop `slot`'s engine and start another in its place (bounded by engine.max_restarts)."""
        assert not slot.external, "servers of engine.urls are not ours to replace"
        old = slot.proc
        old.stop()
        if slot.restarts >= self.plan.engine.max_restarts:
            raise RunFailed(
                f"{slot.name} {why} and was already replaced {slot.restarts} times "
                f"(engine.max_restarts={self.plan.engine.max_restarts}); its log {old.log_path} ends:\n"
                + _indent(tail_lines(old.log_path, 15))
            )
        slot.restarts += 1
        print(
            f"miles: {slot.name} {why}; replacing it ({slot.restarts}/{self.plan.engine.max_restarts}), "
            f"log {old.log_path}",
            file=sys.stderr,
        )
        if self.router is not None:
            try:
                self.router.remove_worker(old.url)
            except Exception as e:  # the router may have dropped it already
                log.warning("router: removing %s: %s", old.url, e)
        slot.proc = self.restart_engine(slot.index)
        slot.failed_checks, slot.next_check = 0, time.monotonic() + self.plan.engine.health_check_interval_s
        if self.router is not None:
            self.router.add_worker(slot.proc.url)
        log.info("%s replaced: %s (pid %d)", slot.name, slot.proc.url, slot.proc.pid)


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def tail_lines(path: Path, n: int) -> str:
    """The last `n` lines of a text file ('(no log)' when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def last_error(text: str, n: int = 6) -> str:
    """The end of the last Python traceback in `text`, or its last `n` non-blank lines."""
    rows = [r for r in text.splitlines() if r.strip()]
    return error_excerpt(text, n) or "\n".join(rows[-n:])


def trainer_error(run_dir: Path) -> tuple[str, Path | None]:
    """(the last error a trainer rank printed, the log it is in), from torchrun's per-rank logs."""
    logs = sorted((run_dir / "logs" / "torchrun").glob("**/stderr.log"), key=lambda p: p.stat().st_mtime)
    for path in reversed(logs):
        text = path.read_text(errors="replace")
        if "Traceback (most recent call last)" in text or "Error" in text:
            return last_error(text), path
    out = run_dir / "logs" / "trainer-stdout.log"
    return last_error(tail_lines(out, 40)), out
