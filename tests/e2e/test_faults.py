"""Faults injected into a real `miles train` on CPU: what Miles does about each (docs/reliability.md).

Every test runs the whole job as a child process (engine, torchrun, trainer rank) and hurts it the
way an operator or a bug would: the engine killed, its scheduler dead, the launcher SIGKILLed or
interrupted. It then checks the run directory and the console.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import finish, miles_train, pids_alive, run_pids, steps_of, stop, wait_for_step

from miles.metrics import read_metrics
from miles.serving import run_keys

pytestmark = pytest.mark.slow


def engine_record(run_dir: Path, name: str = "engine-0") -> dict:
    return json.loads((run_dir / "rendezvous" / "engines" / f"{name}.json").read_text())


def test_engine_killed_mid_run_is_replaced_and_the_run_finishes(recipe) -> None:
    path, run_dir = recipe(train={"steps": 12}, rollout={"schedule": "async"})
    proc = miles_train(str(path))
    try:
        wait_for_step(run_dir, 3, proc)
        first = engine_record(run_dir)
        os.kill(first["pid"], signal.SIGKILL)
        out = finish(proc, timeout_s=500)
    finally:
        stop(proc)
    assert "engine-0 exited with -9; replacing it (1/3)" in out, out[-3000:]
    assert engine_record(run_dir)["url"] != first["url"]
    assert steps_of(run_dir) == list(range(1, 13))  # every step once, through the replacement
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "reconnected to 1 engine(s)" in trainer_log
    assert read_metrics(run_dir)[-1]["engine/replacements"] >= 1


def test_dead_scheduler_makes_the_engine_unhealthy_and_it_is_replaced(recipe) -> None:
    path, run_dir = recipe(
        train={"steps": 10},
        rollout={"schedule": "async"},
        engine={"fault_injection": True, "health_check_interval_s": 0.5},
    )
    proc = miles_train(str(path))
    try:
        wait_for_step(run_dir, 3, proc)
        url = engine_record(run_dir)["url"]
        keys = run_keys(run_dir)  # the run's engines take its keys; this is an admin route
        httpx.post(
            f"{url}/debug/inject_fault",
            json={"kind": "scheduler_death"},
            headers=keys.headers("/debug/inject_fault"),
            timeout=10,
        ).raise_for_status()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        out = finish(proc, timeout_s=500)
    finally:
        stop(proc)
    assert "engine-0 failed /health 3 times in a row; replacing it" in out, out[-3000:]
    assert steps_of(run_dir) == list(range(1, 11))


def test_sigkill_of_miles_train_leaves_no_process_of_the_run(recipe) -> None:
    """Also: the launcher's children are not in its process group. Ctrl-C in a terminal goes to the
    foreground process group: only the launcher may get it."""
    path, run_dir = recipe(train={"steps": 200}, rollout={"schedule": "async"})
    proc = miles_train(str(path))
    try:
        wait_for_step(run_dir, 2, proc)
        children = run_pids(run_dir)
        assert len(children) >= 3, children  # engine, torchrun, trainer rank
        groups = {os.getpgid(pid) for pid in children}
        assert os.getpgid(proc.pid) not in groups, (proc.pid, children)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while pids_alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids_alive(children) == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in children]
    finally:
        for pid in pids_alive(run_pids(run_dir)):  # the test's own cleanup, should it fail
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_checkpoints_prints_the_resume_command_and_exits_128_plus_signal(recipe, sig) -> None:
    path, run_dir = recipe(train={"steps": 200, "checkpoint": {"every_steps": 1000}})
    proc = miles_train(str(path))
    try:
        wait_for_step(run_dir, 2, proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    reached = steps_of(run_dir)[-1]
    assert (run_dir / "checkpoints" / f"step_{reached}" / ".complete").exists()
    assert f"checkpoint of step {reached}" in out
    assert f"--resume {run_dir}" in out
    assert run_pids(run_dir) == []
    if sig == signal.SIGINT:  # the printed resume continues from that checkpoint (once is enough)
        finish(miles_train(str(path), "--resume", str(run_dir), "--set", f"train.steps={reached + 2}"))
        assert steps_of(run_dir) == list(range(1, reached + 3))
        assert f"resumed from checkpoint step {reached}" in (run_dir / "logs" / "trainer-0.log").read_text()


def test_trainer_failure_prints_the_error_and_its_log(recipe) -> None:
    path, run_dir = recipe(rollout={"reward": "e2e_rewards:raises"})
    proc = miles_train(str(path))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode not in (0, None)
    assert "trainer failed" in out and "stderr.log" in out, out[-3000:]
    assert "reward function exploded" in out, out[-3000:]


def test_a_second_process_on_the_run_directory_is_refused_and_reuse_needs_a_flag(recipe) -> None:
    path, run_dir = recipe(train={"steps": 200})
    first = miles_train(str(path))
    try:
        wait_for_step(run_dir, 1, first)
        for args in ([], ["--resume", str(run_dir)]):
            second = miles_train(str(path), *args)
            out, _ = second.communicate(timeout=300)
            assert second.returncode == 2, out[-3000:]
            assert f"pid {first.pid}" in out.lower() or str(first.pid) in out, out[-3000:]
    finally:
        stop(first)
    before = steps_of(run_dir)
    again = miles_train(str(path))
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 2 and "--resume" in out and "--overwrite" in out, out[-3000:]
    assert steps_of(run_dir) == before  # nothing of the earlier run was touched


def test_one_of_two_engines_killed_the_run_continues_and_the_router_gets_its_replacement(recipe) -> None:
    path, run_dir = recipe(train={"steps": 12}, engine={"num_engines": 2}, rollout={"schedule": "async"})
    proc = miles_train(str(path))
    try:
        wait_for_step(run_dir, 3, proc)
        lost = engine_record(run_dir, "engine-1")
        os.kill(lost["pid"], signal.SIGKILL)
        wait_for_step(run_dir, 6, proc)
        router = json.loads((run_dir / "rendezvous" / "router.json").read_text())["url"]
        auth = run_keys(run_dir).headers("/workers")
        workers = {
            w["url"] for w in httpx.get(f"{router}/workers", timeout=10, headers=auth).json()["workers"]
        }
        out = finish(proc, timeout_s=500)
    finally:
        stop(proc)
    assert "engine-1 exited with -9; replacing it" in out, out[-3000:]
    replacement = engine_record(run_dir, "engine-1")["url"]
    assert replacement != lost["url"] and lost["url"] not in workers
    assert steps_of(run_dir) == list(range(1, 13))


def test_ctrl_c_while_the_base_model_is_pretrained_exits_130_without_a_traceback(recipe, tmp_path) -> None:
    import subprocess
    import sys

    path, _ = recipe(
        model={"path": str(tmp_path / "base"), "init_tiny_if_missing": True,
               "tiny": {"corpus": "coding", "vocab_size": 512, "pretrain_steps": 100000}},
    )  # fmt: skip
    # SIGINT at its default in the child: a test run started in the background (`cmd &` in a script)
    # hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "train", str(path)], stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    seen = []
    try:
        for line in proc.stderr:  # progress is printed while it pretrains
            seen.append(line)
            if "miles: pretraining" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any("miles: pretraining" in x for x in seen), "".join(seen)
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest and "miles: interrupted" in rest
    assert not (tmp_path / "base").exists()  # no half-made model left behind
