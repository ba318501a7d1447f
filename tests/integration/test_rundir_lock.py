"""The run directory lock between real processes: a live owner refuses others, a SIGKILLed owner's
lock is taken over, of several processes racing for a stale lock exactly one wins, and (on the
Slurm dev cluster) a lock held inside a job names the job and is freed once Slurm says it ended."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.launch.rundir import RunDirBusy, RunDirLock, read_owner, slurm_job_state
from miles.processes import pid_alive

# Says it is ready, waits for a line on stdin, tries the lock, prints the outcome, then holds the
# lock until its stdin closes.
CONTENDER = """
import sys
from miles.launch.rundir import RunDirBusy, RunDirLock
print("ready", flush=True)
sys.stdin.readline()
try:
    lock = RunDirLock.acquire(sys.argv[1])
except RunDirBusy as e:
    print("busy", e.owner.pid if e.owner else "-", flush=True)
    sys.exit(3)
print("locked", lock.taken_over.pid if lock.taken_over else "-", flush=True)
sys.stdin.read()
lock.release()
"""


def _start(run_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CONTENDER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _locked_owner(run_dir: Path) -> subprocess.Popen[str]:
    proc = _start(run_dir)
    assert proc.stdout.readline() == "ready\n"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().split() == ["locked", "-"]
    return proc


def test_a_second_process_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    first = _locked_owner(tmp_path)
    try:
        try:
            RunDirLock.acquire(tmp_path)
            raise AssertionError("a second process took a held lock")
        except RunDirBusy as e:
            assert f"host {os.uname().nodename}, pid {first.pid}," in str(e)
        second = _start(tmp_path)
        out, _ = second.communicate("go\n", timeout=60)
        assert (second.returncode, out.split()) == (3, ["ready", "busy", str(first.pid)])
    finally:
        first.stdin.close()
        assert first.wait(timeout=60) == 0
    assert read_owner(tmp_path) is None  # released on a clean exit
    with RunDirLock.acquire(tmp_path) as lock:
        assert lock.taken_over is None


def test_lock_of_a_sigkilled_owner_is_taken_over(tmp_path: Path) -> None:
    owner = _locked_owner(tmp_path)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=60)
    owner.stdin.close()
    owner.stdout.close()
    assert read_owner(tmp_path).pid == owner.pid  # a killed process leaves its lock behind
    with RunDirLock.acquire(tmp_path) as lock:
        assert lock.taken_over.pid == owner.pid
        assert read_owner(tmp_path).pid == os.getpid()


def test_exactly_one_of_several_processes_takes_a_stale_lock(tmp_path: Path) -> None:
    dead = _locked_owner(tmp_path)
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=60)
    procs = [_start(tmp_path) for _ in range(5)]
    try:
        assert all(p.stdout.readline() == "ready\n" for p in procs)
        for p in procs:  # release them together, each one past its imports
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [p.stdout.readline().split() for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
            p.stdout.close()
        dead.stdin.close()
        dead.stdout.close()
    winners = [procs[i].pid for i, r in enumerate(results) if r[0] == "locked"]
    assert len(winners) == 1, results
    # the guard's flock lets one contender at a time look, so the winner is the one that took over
    assert all(r == ["locked", str(dead.pid)] or r == ["busy", str(winners[0])] for r in results), results


def _slurm_missing() -> str | None:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "Slurm is not installed (see .ci/run)"
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    up = out.returncode == 0 and any(s in ("idle", "mixed") for s in out.stdout.split())
    return None if up else "dev cluster not up (make slurm-up)"


HOLDER = """
import sys, time
from miles.launch.rundir import RunDirLock
with RunDirLock.acquire(sys.argv[1]):
    time.sleep(600)
"""


def _wait_for(check, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout_s} s")


@pytest.mark.slurm
@pytest.mark.skipif(_slurm_missing() is not None, reason=_slurm_missing() or "")
def test_lock_held_by_a_slurm_job_names_the_job_and_frees_once_it_ended(tmp_path: Path) -> None:
    run_dir, elsewhere = tmp_path / "run", tmp_path / "seen-from-another-host"
    (tmp_path / "hold.py").write_text(HOLDER)
    cmd = f"{sys.executable} {tmp_path / 'hold.py'} {run_dir}"
    job = subprocess.run(
        ["sbatch", "--parsable", "-o", str(tmp_path / "job.out"), "--wrap", cmd],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        owner = _wait_for(lambda: (o := read_owner(run_dir)) and o.job_id == job and o, "lock of the job")
        with pytest.raises(RunDirBusy, match=f"pid {owner.pid}, Slurm job {job},.*scancel {job}"):
            RunDirLock.acquire(run_dir)
        # the same record as a process on another host sees it: only Slurm can say the job ended
        elsewhere.mkdir()
        record = json.loads((run_dir / ".lock").read_text()) | {"host": "another-host"}
        (elsewhere / ".lock").write_text(json.dumps(record))
        with pytest.raises(RunDirBusy, match=f"Slurm job {job}"):
            RunDirLock.acquire(elsewhere)
    finally:
        subprocess.run(["scancel", job], check=False)
    _wait_for(lambda: (slurm_job_state(job) or "").startswith("CANCELLED"), "CANCELLED state in sacct")
    with RunDirLock.acquire(elsewhere) as lock:  # the job ended: its lock is stale wherever it was taken
        assert lock.taken_over.job_id == job
    _wait_for(lambda: not pid_alive(owner.pid), f"exit of the job's process {owner.pid}")
    with RunDirLock.acquire(run_dir) as lock:  # same host: its PID decides
        assert lock.taken_over.pid == owner.pid
