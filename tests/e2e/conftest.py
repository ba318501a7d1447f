"""Helpers for end-to-end runs: a tiny recipe, and `miles train` as a real child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from miles.metrics import read_metrics

HERE = Path(__file__).resolve().parent

BASE = {
    "run": {"name": "e2e", "seed": 0, "tensorboard": False},
    "model": {"init_tiny_if_missing": False},
    "engine": {"max_running_requests": 64},
    "rollout": {
        "task": {"name": "digits", "options": {"op": "last", "num_digits": 1}, "eval_size": 5},
        "reward": "miles.rollout.rewards:first_number",
        "prompts_per_step": 4,
        "n_samples_per_prompt": 4,
        "max_new_tokens": 3,
        "max_concurrency_per_engine": 32,
    },
    "eval": {"every_steps": 0},
    "train": {"steps": 4, "lr": 1e-3, "max_tokens_per_microbatch": 512},
    "weights": {"transport": "distributed"},
}


def deep_update(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_update(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


@pytest.fixture
def recipe(tmp_path, tiny_model):
    """recipe(**sections) -> (recipe path, run dir) for a run under tmp_path."""

    def make(**sections) -> tuple[Path, Path]:
        data = deep_update(
            BASE, {"run": {"runs_root": str(tmp_path / "runs")}, "model": {"path": tiny_model}}
        )
        data = deep_update(data, sections)
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(data))
        return path, tmp_path / "runs" / data["run"]["name"]

    return make


def miles_train(recipe: Path, *args: str) -> subprocess.Popen:
    """`miles train RECIPE ARGS` as a child process (its own process group is not needed: it stops its children)."""
    cmd = [sys.executable, "-m", "miles.cli", "train", str(recipe), *args]
    # the trainer imports test rewards (e2e_rewards) by dotted path, so this folder goes on its path
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen, timeout_s: float = 400) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise
    assert proc.returncode == 0, out[-3000:]
    return out


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops the engines and trainer it started), then wait."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in read_metrics(run_dir)):
            return
        assert proc.poll() is None, f"run ended early: {proc.stdout.read()[-3000:] if proc.stdout else ''}"
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached in {timeout_s} s")


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def steps_of(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


def run_pids(run_dir: Path) -> list[int]:
    """PIDs of every live process whose command line names the run directory (engines, torchrun, ranks)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if str(run_dir) in cmd and state != "Z":
            out.append(int(entry.name))
    return out


def wait_gone(run_dir: Path, timeout_s: float = 15) -> list[int]:
    """Wait until no process of the run is left (children die with their launcher); those still alive."""
    deadline = time.monotonic() + timeout_s
    while (alive := run_pids(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive
