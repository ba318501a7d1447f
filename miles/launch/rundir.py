"""Run directory ownership: one process at a time, and no earlier run lost without being asked.

    RUN_DIR/.lock        owner record (JSON): host, pid, start_ticks, job_id, restart_count, since, ...
    RUN_DIR/.lock.guard  empty; its flock serialises acquisitions where the filesystem has flock (kept)

`RunDirLock.acquire(run_dir)` takes the lock for as long as the `with` block (or until `release()`);
a second process is refused with `RunDirBusy`, whose message names the owner. The lock file is
created atomically (the complete record is written to a private file, then hard-linked to `.lock`,
which fails when `.lock` exists), and the owner also holds `fcntl.flock` on it where the filesystem
supports that, so a live owner is recognised even where its PID cannot be checked.

A lock whose owner is gone is stale and is taken over with a warning:
- owner on this host: its PID no longer runs, or the PID now belongs to another process (the start
  time in /proc/PID/stat differs from the one recorded);
- owner on another host with a Slurm job id: it is an earlier incarnation of our own job (a requeue),
  or Slurm (sacct, through submitit) says the job has ended. sacct says so as soon as the job is
  cancelled, while its processes may run on for Slurm's KillWait; a live owner's flock (where the
  shared filesystem has working flock) still refuses a takeover then;
- any other owner on another host is held; the refusal says how to remove its lock.
Acquisitions are serialised by the guard's flock. Where flock is missing, takeover is
rename-then-check: the stale file is renamed aside (only one contender can do that), then compared
byte for byte with the record judged stale; a lock that turns out to be another one is put back and
the acquisition retried.

`prepare_run_dir(run_dir, resume=..., overwrite=...)` (called under the lock, before the new run
writes anything) refuses a directory that holds an earlier run's outputs unless `--resume` or
`--overwrite` was given; with `--overwrite` it removes them, logs a warning naming them and returns
them. Imports no torch.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from miles.config import ConfigError
from miles.processes import pid_alive

try:
    import fcntl
except ImportError:  # not POSIX: the lock file alone decides
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("miles.launch")

LOCK_FILE = ".lock"
GUARD_FILE = ".lock.guard"

RUN_OUTPUTS = (
    "checkpoints",
    "rendezvous",
    "weights",
    "tensorboard",
    "plots",
    "control",
    "metrics.jsonl",
    "logs",
)
"""What a run writes into its directory; `--overwrite` removes these. plan.yaml and the Slurm
submission files (submission.sh, launch.json, job.json) are replaced by whoever starts the new run."""

EARLIER_RUN = ("metrics.jsonl", "checkpoints", "weights", "tensorboard", "plots", "logs")
"""Outputs whose presence (holding at least one file) means an earlier run produced something. A
directory with only plan.yaml (a dry run, or a start that failed before anything ran) is free."""

_SLURM_ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)


@dataclass(frozen=True)
class LockOwner:
    """Who holds (or held) a run directory's lock."""

    host: str
    """os.uname().nodename of the owner."""
    pid: int
    start_ticks: int | None
    """Start time of the PID (field 22 of /proc/PID/stat, clock ticks since boot); None off Linux."""
    job_id: str | None
    """SLURM_JOB_ID (through JobEnvironment) when the owner runs inside a Slurm job."""
    restart_count: int
    """SLURM_RESTART_COUNT of the owner: a requeued job is a later incarnation of the same job id."""
    since: float
    """Unix time at which the lock was taken."""
    command: str
    """The owner's command line (shortened)."""
    token: str
    """Unique id of this acquisition (tells our own record from another's)."""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"host {self.host}, pid {self.pid}{job}, since {when} ({self.command!r})"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> LockOwner:
        d = json.loads(text)
        return cls(
            host=str(d["host"]),
            pid=int(d["pid"]),
            start_ticks=None if d.get("start_ticks") is None else int(d["start_ticks"]),
            job_id=None if d.get("job_id") is None else str(d["job_id"]),
            restart_count=int(d.get("restart_count", 0)),
            since=float(d.get("since", 0.0)),
            command=str(d.get("command", "")),
            token=str(d.get("token", "")),
        )


class RunDirBusy(ConfigError):
    """Another process owns the run directory; the message names it and says what to do."""

    def __init__(self, run_dir: Path, owner: LockOwner | None, detail: str = "") -> None:
        self.run_dir = run_dir
        self.owner = owner
        lock = run_dir / LOCK_FILE
        who = owner.describe() if owner else f"an unreadable lock file {lock}"
        stop = ""
        if owner:
            stop = (
                f" or stop it (scancel {owner.job_id})" if owner.job_id else f" or stop it (kill {owner.pid})"
            )
        super().__init__(
            f"run directory {run_dir} is in use by another process: {who}{detail}. Wait for it to end{stop},"
            f" or give this run another run.name. If that process is gone (one on another host cannot be"
            f" checked from here), delete {lock}"
        )


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22); None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": field 3 is fields[0]
    return int(fields[19]) if len(fields) > 19 else None


def this_process() -> LockOwner:
    """The owner record of the calling process."""
    from miles.cluster.environment import JobEnvironment

    env = JobEnvironment.from_env()
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else ""
    return LockOwner(
        host=os.uname().nodename,
        pid=os.getpid(),
        start_ticks=process_start_ticks(os.getpid()),
        job_id=env.job_id,
        restart_count=env.restart_count,
        since=time.time(),
        command=command[:200],
        token=uuid.uuid4().hex,
    )


def slurm_job_state(job_id: str) -> str | None:
    """A Slurm job's state as sacct reports it (through submitit); None when Slurm cannot be asked."""
    try:
        from miles.launch.jobs import job_object, job_state

        state = job_state(job_object(Path.cwd(), job_id))  # the folder only names files; nothing is written
    except Exception as e:  # no Slurm client here, or sacct failed: the caller keeps the lock
        log.debug("sacct for job %s failed: %s", job_id, e)
        return None
    return None if state == "UNKNOWN" else state


def stale_reason(
    owner: LockOwner, me: LockOwner, job_state: Callable[[str], str | None] = slurm_job_state
) -> str | None:
    """Why the lock of `owner` is stale as seen by `me`, or None while it must be taken as held."""
    if owner.host == me.host:
        if not pid_alive(owner.pid):
            return f"process {owner.pid} no longer runs"
        ticks = process_start_ticks(owner.pid)
        if owner.start_ticks is not None and ticks is not None and ticks != owner.start_ticks:
            return f"pid {owner.pid} now belongs to another process"
        return None
    if owner.job_id is None:
        return None
    if owner.job_id == me.job_id and me.restart_count > owner.restart_count:
        return f"Slurm job {owner.job_id} was requeued (restart {owner.restart_count} -> {me.restart_count})"
    state = job_state(owner.job_id)
    if state is not None and state.startswith(_SLURM_ENDED):
        return f"Slurm job {owner.job_id} has ended ({state})"
    return None


def _flock(fd: int, shared: bool) -> bool | None:
    """Non-blocking flock on fd: True taken, False held by another, None unsupported here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        return False if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) else None
    return True


def flock_held(path: Path) -> bool:
    """Whether some process holds an exclusive flock on `path` (False when absent or unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return _flock(fd, shared=True) is False  # shared probes never conflict with one another
    finally:
        os.close(fd)  # also drops the probe's shared lock


@contextmanager
def _acquisitions_serialised(run_dir: Path, wait_s: float = 30.0) -> Iterator[None]:
    """Hold an exclusive flock on RUN_DIR/.lock.guard (kept, never deleted) while one process looks
    at, takes over or creates the lock, so that contenders for a stale lock cannot interleave.
    Where flock is unsupported, or the guard stays taken for wait_s, the lock file's own protocol
    (atomic create, rename-then-check takeover) is all there is."""
    fd = os.open(run_dir / GUARD_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while (taken := _flock(fd, shared=False)) is False and time.monotonic() < deadline:
            time.sleep(0.01)
        if taken is False:
            log.warning("run directory %s: %s stayed taken for %.0f s; going on", run_dir, GUARD_FILE, wait_s)
        yield
    finally:
        os.close(fd)


def _read_lock(path: Path) -> tuple[bytes | None, LockOwner | None]:
    """(raw bytes, parsed owner) of a lock file; (None, None) when it does not exist."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        return raw, LockOwner.from_json(raw)
    except (ValueError, KeyError, TypeError):
        return raw, None


def read_owner(run_dir: str | Path) -> LockOwner | None:
    """The owner recorded in RUN_DIR/.lock (live or stale), or None when there is none."""
    return _read_lock(Path(run_dir) / LOCK_FILE)[1]


def current_owner(
    run_dir: str | Path, job_state: Callable[[str], str | None] = slurm_job_state
) -> LockOwner | None:
    """The live owner of the run directory, or None when it is free (no lock, or a stale one).
    For checks that do not take the lock (e.g. before submitting a job that will take it)."""
    path = Path(run_dir) / LOCK_FILE
    raw, owner = _read_lock(path)
    if raw is None:
        return None
    if owner is None:
        raise RunDirBusy(Path(run_dir), None)
    if flock_held(path) or stale_reason(owner, this_process(), job_state) is None:
        return owner
    return None


class RunDirLock:
    """The lock of one run directory, held by this process from `acquire` until `release`."""

    run_dir: Path
    owner: LockOwner | None
    """Our record while held; None before acquisition and after release."""
    taken_over: LockOwner | None
    """The stale owner whose lock this acquisition replaced, if any."""

    def __init__(self, run_dir: str | Path, job_state: Callable[[str], str | None] = slurm_job_state) -> None:
        self.run_dir = Path(run_dir)
        self.owner = None
        self.taken_over = None
        self._job_state = job_state
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE

    @classmethod
    def acquire(
        cls, run_dir: str | Path, job_state: Callable[[str], str | None] = slurm_job_state
    ) -> RunDirLock:
        """Take the lock of `run_dir` (created if missing) or raise RunDirBusy naming its owner.
        The result is a context manager that releases the lock on exit."""
        lock = cls(run_dir, job_state)
        lock._acquire()
        return lock

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with _acquisitions_serialised(self.run_dir):
            self._acquire_once()

    def _acquire_once(self) -> None:
        me = this_process()
        seen: LockOwner | None = None
        for _ in range(5):
            if self._create(me):
                return
            raw, seen = _read_lock(self.path)
            if raw is None:
                continue  # released between our two looks
            if seen is None:
                raise RunDirBusy(self.run_dir, None)
            if flock_held(self.path):
                raise RunDirBusy(self.run_dir, seen)
            reason = stale_reason(seen, me, self._job_state)
            if reason is None:
                raise RunDirBusy(self.run_dir, seen)
            self._take_over(raw, seen, reason, me)
        raise RunDirBusy(self.run_dir, seen, " (its lock changed hands several times while we looked)")

    def _create(self, me: LockOwner) -> bool:
        """Publish our complete record as `.lock` in one step; False when a lock exists already."""
        private = self.run_dir / f"{LOCK_FILE}.{me.token}"
        private.write_text(me.to_json())
        try:
            os.link(private, self.path)
        except FileExistsError:
            return False
        except OSError as e:
            raise ConfigError(
                f"cannot create the lock {self.path}: {e}; run.runs_root must be on a filesystem with "
                "hard links (any local or cluster filesystem has them)"
            ) from None
        finally:
            private.unlink(missing_ok=True)
        self.owner = me
        self._fd = os.open(self.path, os.O_RDWR)  # NFS grants an exclusive flock to writers only
        for _ in range(50):  # a prober holds a shared flock for an instant only
            if _flock(self._fd, shared=False) is not False:
                break
            time.sleep(0.01)
        return True

    def _take_over(self, raw: bytes, stale: LockOwner, reason: str, me: LockOwner) -> None:
        """Move the stale lock aside; if what moved is not the lock judged stale, put it back."""
        aside = self.run_dir / f"{LOCK_FILE}.stale.{me.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it first
        try:
            if aside.read_bytes() == raw and not flock_held(aside):
                log.warning(
                    "run directory %s: taking over the stale lock of %s: %s",
                    self.run_dir,
                    stale.describe(),
                    reason,
                )
                self.taken_over = stale
                return
            try:
                os.link(aside, self.path)  # a newer owner's lock: restore it
            except FileExistsError:
                log.error("run directory %s: a lock was moved while a third process took it", self.run_dir)
        finally:
            aside.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove our lock (only if `.lock` is still ours) and drop the flock. Safe to call twice."""
        if self.owner is None:
            return
        raw, seen = _read_lock(self.path)
        if seen is not None and seen.token == self.owner.token:
            self.path.unlink(missing_ok=True)
        elif raw is not None:
            log.warning("run directory %s: the lock is no longer ours; left in place", self.run_dir)
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.owner = None, None


def _files_under(path: Path) -> int:
    """How many files `path` is or holds (0 when absent)."""
    if path.is_file():
        return 1
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def earlier_run(run_dir: str | Path) -> list[str]:
    """The EARLIER_RUN outputs present in run_dir (holding files); empty when the directory is free."""
    return [name for name in EARLIER_RUN if _files_under(Path(run_dir) / name)]


def planned_steps(run_dir: Path) -> int | None:
    import yaml

    try:
        return int(yaml.safe_load((run_dir / "plan.yaml").read_text())["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def describe_earlier_run(run_dir: str | Path) -> str:
    """One line: how far the earlier run in run_dir got and what it left there."""
    from miles.metrics import METRICS_FILE, read_metrics
    from miles.train.checkpoint import complete_steps

    run_dir = Path(run_dir)
    steps = [int(r["step"]) for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    planned = planned_steps(run_dir)
    of = f" of {planned}" if planned else ""
    if not steps:
        state = "stopped before its first step"
    elif planned and max(steps) >= planned:
        state = f"finished, {planned} steps"
    else:
        state = f"interrupted at step {max(steps)}{of}"
    parts = [f"{METRICS_FILE} with steps {min(steps)}-{max(steps)}"] if steps else []
    found = earlier_run(run_dir)
    if "checkpoints" in found:
        done = complete_steps(run_dir)
        parts.append(
            f"checkpoints {', '.join(f'step_{s}' for s in done)}" if done else "no complete checkpoint"
        )
    others = [n for n in found if n not in (METRICS_FILE, "checkpoints")]
    parts += [f"{name}/ ({_files_under(run_dir / name)} files)" for name in others]
    return f"{state}: {'; '.join(parts)}" if parts else state


def _remove(path: Path) -> bool:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return False
    return True


def prepare_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> list[str]:
    """Make run_dir ready for a start; call it holding the run's lock, before writing anything.

    A directory holding an earlier run's outputs (see EARLIER_RUN) is refused unless `resume`
    (continue it: only rendezvous/, the per-start records, is removed) or `overwrite` (every
    RUN_OUTPUTS entry is removed, with a warning naming them). A fresh start into a free directory
    removes only leftovers that hold no data (rendezvous/, control/, empty folders).
    Returns the paths removed.
    """
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ConfigError(
            f"--resume continues the run in {run_dir} and --overwrite deletes it: give only one of them"
        )
    found = earlier_run(run_dir)
    if found and not (resume or overwrite):
        raise ConfigError(
            f"run directory {run_dir} holds an earlier run ({describe_earlier_run(run_dir)}). Continue it "
            f"with --resume {run_dir}, delete it and start again with --overwrite, or set another run.name"
        )
    if found and overwrite:
        log.warning(
            "--overwrite: removing the earlier run in %s (%s)", run_dir, describe_earlier_run(run_dir)
        )
    names = ("rendezvous",) if resume else RUN_OUTPUTS
    removed = [str(run_dir / name) for name in names if _remove(run_dir / name)]
    if found and overwrite:
        log.warning("--overwrite: removed %s", ", ".join(removed))
    return removed
