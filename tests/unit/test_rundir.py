"""Run directory ownership: the lock's owner record, stale-lock rules, and reuse of a run directory."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.launch.rundir import (
    GUARD_FILE,
    LOCK_FILE,
    LockOwner,
    RunDirBusy,
    RunDirLock,
    current_owner,
    prepare_run_dir,
    process_start_ticks,
    read_owner,
    this_process,
)


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests decide for themselves whether the process runs inside a Slurm job."""
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def _plant(run_dir: Path, **fields: object) -> LockOwner:
    """Write a lock record as another process would have left it."""
    d = {
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "start_ticks": process_start_ticks(os.getpid()),
        "job_id": None,
        "restart_count": 0,
        "since": 1_700_000_000.0,
        "command": "miles train recipes/x.yaml",
        "token": "planted",
    }
    d.update(fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps(d))
    return LockOwner.from_json(json.dumps(d))


def _never(job_id: str) -> str | None:
    raise AssertionError(f"Slurm asked about job {job_id} although the owner's host decides")


def test_owner_record_names_this_process(tmp_path: Path) -> None:
    with RunDirLock.acquire(tmp_path / "run") as lock:
        owner = read_owner(tmp_path / "run")
        assert owner == lock.owner
        assert (owner.host, owner.pid, owner.job_id) == (os.uname().nodename, os.getpid(), None)
        assert owner.start_ticks == process_start_ticks(os.getpid())
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert [p.name for p in (tmp_path / "run").iterdir()] == [GUARD_FILE]  # no private files left behind


def test_second_acquirer_is_refused_naming_the_owner(tmp_path: Path) -> None:
    with RunDirLock.acquire(tmp_path) as lock:
        with pytest.raises(RunDirBusy) as e:
            RunDirLock.acquire(tmp_path)
        assert e.value.owner == lock.owner
        msg = str(e.value)
        assert f"host {os.uname().nodename}, pid {os.getpid()}" in msg and "since 20" in msg
        assert current_owner(tmp_path) == lock.owner
    with RunDirLock.acquire(tmp_path):  # free again once released
        pass


def test_owner_in_a_slurm_job_is_recorded_with_its_job_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with RunDirLock.acquire(tmp_path):
        owner = read_owner(tmp_path)
        assert (owner.job_id, owner.restart_count) == ("4242", 2)
        with pytest.raises(RunDirBusy, match="Slurm job 4242.*scancel 4242"):
            RunDirLock.acquire(tmp_path)


def test_lock_of_a_dead_pid_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = _plant(tmp_path, pid=child.pid, start_ticks=None)
    with caplog.at_level(logging.WARNING, "miles.launch"):
        with RunDirLock.acquire(tmp_path, job_state=_never) as lock:
            assert lock.taken_over == stale
            assert read_owner(tmp_path).pid == os.getpid()
    assert f"pid {child.pid}" in caplog.text and "stale" in caplog.text


def test_reused_pid_is_told_apart_by_its_start_time(tmp_path: Path) -> None:
    ours = process_start_ticks(os.getpid())
    if ours is None:
        pytest.skip("no /proc/PID/stat on this system")
    _plant(tmp_path, start_ticks=ours)  # our own live process: held
    with pytest.raises(RunDirBusy):
        RunDirLock.acquire(tmp_path, job_state=_never)
    _plant(tmp_path, start_ticks=ours - 1)  # same PID, another process: stale
    with RunDirLock.acquire(tmp_path, job_state=_never) as lock:
        assert lock.taken_over is not None and lock.taken_over.start_ticks == ours - 1


def test_lock_from_another_host_is_held_and_the_refusal_says_how_to_remove_it(tmp_path: Path) -> None:
    _plant(tmp_path, host="gpu-node-07", pid=1234)
    with pytest.raises(RunDirBusy) as e:
        RunDirLock.acquire(tmp_path, job_state=_never)
    assert "host gpu-node-07, pid 1234" in str(e.value)
    assert f"delete {tmp_path / LOCK_FILE}" in str(e.value)
    assert read_owner(tmp_path).host == "gpu-node-07"  # untouched


@pytest.mark.parametrize(("state", "stale"), [("RUNNING", False), (None, False), ("CANCELLED by 0", True)])
def test_slurm_owner_on_another_host_is_stale_only_once_its_job_ended(
    tmp_path: Path, state: str | None, stale: bool
) -> None:
    _plant(tmp_path, host="gpu-node-07", pid=1234, job_id="977")
    asked: list[str] = []

    def job_state(job_id: str) -> str | None:
        asked.append(job_id)
        return state

    if stale:
        with RunDirLock.acquire(tmp_path, job_state=job_state) as lock:
            assert lock.taken_over.job_id == "977"
    else:
        with pytest.raises(RunDirBusy, match="Slurm job 977.*scancel 977"):
            RunDirLock.acquire(tmp_path, job_state=job_state)
    assert asked and set(asked) == {"977"}


def test_requeued_job_takes_over_the_lock_of_its_earlier_incarnation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(tmp_path, host="gpu-node-07", pid=1234, job_id="977", restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "977")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with RunDirLock.acquire(tmp_path, job_state=_never) as lock:
        assert lock.taken_over.restart_count == 0 and lock.owner.restart_count == 1


def test_unreadable_lock_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text("{not json")
    with pytest.raises(RunDirBusy, match="unreadable lock file") as e:
        RunDirLock.acquire(tmp_path)
    assert str(tmp_path / LOCK_FILE) in str(e.value)


def test_takeover_puts_back_a_lock_that_changed_after_it_was_judged_stale(tmp_path: Path) -> None:
    """The race rename-then-check guards: another process replaced the stale lock before we moved it."""
    stale_raw = json.dumps({"host": "h", "pid": 1, "token": "old"}).encode()
    newer = _plant(tmp_path, token="newer")
    lock = RunDirLock(tmp_path)
    lock._take_over(stale_raw, LockOwner.from_json(stale_raw), "test", this_process())
    assert read_owner(tmp_path) == newer
    assert lock.taken_over is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path: Path) -> None:
    lock = RunDirLock.acquire(tmp_path)
    other = _plant(tmp_path, token="someone-else")
    lock.release()
    lock.release()
    assert read_owner(tmp_path) == other


# --- reuse of a run directory ---------------------------------------------------------------------


def _earlier_run(run_dir: Path, last_step: int, planned: int = 10) -> None:
    """A run directory as the loop leaves it: plan, metrics rows 0..last_step, checkpoints, logs."""
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_2" / ".complete").write_text("2\n")
    (run_dir / "checkpoints" / "step_2" / "trainer.pt").write_bytes(b"x")
    (run_dir / "rendezvous" / "engines").mkdir(parents=True)
    (run_dir / "rendezvous" / "engines" / "0.json").write_text("{}")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "trainer-0.log").write_text("step 1\n")
    (run_dir / "plan.yaml").write_text(f"train:\n  steps: {planned}\n")
    rows = [json.dumps({"step": s, "time": 0.0}) for s in range(last_step + 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def test_reuse_without_resume_or_overwrite_is_refused_and_keeps_everything(tmp_path: Path) -> None:
    _earlier_run(tmp_path, last_step=3)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(tmp_path, resume=False, overwrite=False)
    msg = str(e.value)
    assert f"--resume {tmp_path}" in msg and "--overwrite" in msg
    assert "interrupted at step 3 of 10" in msg and "step_2" in msg
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_refusal_says_when_the_earlier_run_finished(tmp_path: Path) -> None:
    _earlier_run(tmp_path, last_step=10)
    with pytest.raises(ConfigError, match="finished, 10 steps"):
        prepare_run_dir(tmp_path, resume=False, overwrite=False)


def test_overwrite_removes_the_earlier_run_and_reports_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _earlier_run(tmp_path, last_step=3)
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_text("x")
    with caplog.at_level(logging.WARNING, "miles.launch"):
        removed = prepare_run_dir(tmp_path, resume=False, overwrite=True)
    names = {"checkpoints", "rendezvous", "tensorboard", "metrics.jsonl", "logs"}
    assert sorted(removed) == sorted(str(tmp_path / n) for n in names)
    assert not any((tmp_path / n).exists() for n in names)
    assert "interrupted at step 3" in caplog.text and str(tmp_path / "checkpoints") in caplog.text
    prepare_run_dir(tmp_path, resume=False, overwrite=False)  # the directory is free now


def test_resume_keeps_checkpoints_and_metrics(tmp_path: Path) -> None:
    _earlier_run(tmp_path, last_step=3)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    removed = prepare_run_dir(tmp_path, resume=True, overwrite=False)
    assert removed == [str(tmp_path / "rendezvous")]
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    assert (tmp_path / "checkpoints" / "step_2" / "trainer.pt").read_bytes() == b"x"
    assert (tmp_path / "logs" / "trainer-0.log").exists() and (tmp_path / "plan.yaml").exists()


def test_directory_without_outputs_is_free(tmp_path: Path) -> None:
    """A dry run (or a start that failed before anything ran) leaves plan.yaml and empty folders only."""
    (tmp_path / "logs" / "slurm").mkdir(parents=True)
    (tmp_path / "rendezvous").mkdir()
    (tmp_path / "rendezvous" / "router.json").write_text("{}")
    (tmp_path / "plan.yaml").write_text("train:\n  steps: 10\n")
    with RunDirLock.acquire(tmp_path):
        removed = prepare_run_dir(tmp_path, resume=False, overwrite=False)
        assert sorted(removed) == [str(tmp_path / "logs"), str(tmp_path / "rendezvous")]
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, GUARD_FILE, "plan.yaml"]


def test_resume_and_overwrite_together_are_refused(tmp_path: Path) -> None:
    _earlier_run(tmp_path, last_step=3)
    with pytest.raises(ConfigError, match="only one"):
        prepare_run_dir(tmp_path, resume=True, overwrite=True)
    assert (tmp_path / "metrics.jsonl").exists()


def test_rundir_imports_no_torch() -> None:
    code = "import sys, miles.launch.rundir; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_miles_status_answers_for_runs_of_miles_train(tmp_path) -> None:
    import subprocess
    import sys

    run = tmp_path / "local-run"
    run.mkdir()
    (run / "plan.yaml").write_text("train:\n  steps: 3\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n{"step": 2, "train/loss": 0.4}\n')
    out = subprocess.run(
        [sys.executable, "-m", "miles.cli", "status", str(run)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "STOPPED" in out.stdout and "local" in out.stdout
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "train/loss": 0.3}\n')
    out = subprocess.run(
        [sys.executable, "-m", "miles.cli", "status", str(run)], capture_output=True, text=True
    )
    assert "COMPLETED" in out.stdout and "summary: 1/1 completed" in out.stdout, out.stdout
