"""eval.cpus: dedicated eval engines on cores of their own, training processes on the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, resolve
from miles.engine.process import start_engine
from miles.launch.local import eval_cores, share_cpu_threads

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason=f"needs 2 cores for this process, it has {CORES}")


def _plan(*overrides: str):
    return resolve({}, ["eval.mode=dedicated", "eval.every_steps=1", *overrides])


def _allowed(pid: int) -> set[int]:
    """Cores of every thread of process pid (from /proc: the threads inherit the main thread's)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= os.sched_getaffinity(int(task.name))
    return out


def test_bad_eval_cpus_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"eval\.cpus"):
        resolve({}, ["eval.cpus=[1,1]"])
    with pytest.raises(ConfigError, match=r"eval\.cpus \[100000\]: cores \[100000\] are not this process"):
        eval_cores(_plan("eval.cpus=[100000]"))
    with pytest.raises(ConfigError, match="leave one for training"):
        eval_cores(_plan(f"eval.cpus={json.dumps(CORES)}"))


def test_eval_cpus_apply_only_to_dedicated_evaluation():
    assert eval_cores(_plan(f"eval.cpus=[{CORES[0]}]", "eval.mode=shared")) == set()
    assert eval_cores(_plan(f"eval.cpus=[{CORES[0]}]", "eval.every_steps=0")) == set()


@two_cores
def test_reserving_eval_cores_moves_training_off_them():
    """In a child (the reservation changes the calling process): the cores left, and the threads
    share_cpu_threads hands each training process, no longer count the eval engine."""
    code = (
        "import os, sys; from miles.config import resolve;"
        "from miles.launch.local import reserve_eval_cores, share_cpu_threads;"
        f"p = resolve({{}}, ['eval.mode=dedicated', 'eval.every_steps=1', 'eval.cpus=[{CORES[-1]}]']);"
        "os.environ.pop('OMP_NUM_THREADS', None); reserve_eval_cores(p);"
        "print(sorted(os.sched_getaffinity(0)), share_cpu_threads(p))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    cores, threads = out.strip().rsplit(" ", 1)
    assert json.loads(cores) == CORES[:-1]
    assert int(threads) == max(1, len(CORES[:-1]) // 2)  # one engine + one trainer rank share them


def test_shared_eval_engine_counts_among_the_thread_sharers(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # recorded, so the value share_cpu_threads sets is undone
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert share_cpu_threads(_plan()) == max(1, len(CORES) // 3)


@two_cores
def test_engine_started_on_given_cores_keeps_every_thread_there(tiny_model, tmp_path):
    with start_engine(tiny_model, device="cpu", log_path=tmp_path / "engine.log", cpus={CORES[-1]}) as e:
        assert _allowed(e.proc.pid) == {CORES[-1]}
        assert len(list(Path(f"/proc/{e.proc.pid}/task").iterdir())) > 1  # threads started after the pin


@two_cores
def test_eval_driver_and_its_engine_run_on_the_eval_cores(tiny_model, tmp_path):
    """Trainer rank 0's eval driver (requests, scoring: a process of its own) and the engine it
    starts, on eval.cpus; this process keeps its cores."""
    import time

    from miles.eval.runner import DedicatedRunner

    plan = _plan(f"model.path={tiny_model}", f"eval.cpus=[{CORES[-1]}]")
    runner = DedicatedRunner(plan, tmp_path)
    state = tmp_path / "logs" / "eval-driver.json"
    try:
        deadline = time.monotonic() + 120
        while not state.exists() and runner.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        engines = json.loads(state.read_text())["engines"]  # written once its engines serve
        assert _allowed(runner.proc.pid) == {CORES[-1]}
        assert [_allowed(e["pid"]) for e in engines] == [{CORES[-1]}]
        assert os.sched_getaffinity(0) == set(CORES)  # the training process is left as it was
    finally:
        runner.stop()
