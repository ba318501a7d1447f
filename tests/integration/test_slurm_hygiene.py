"""Job hygiene on the one-host Slurm dev cluster (`make slurm-up`): a submission from a fresh clone
prepares what it needs and completes, a rollout component that fails at start ends the job at once
with the component named, and every process runs the intra-op threads its allocation gives it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm_cluster import REASON, REPO, SELFTEST, TINY, _wait

from miles.launch.status import format_table, run_logs, run_status
from miles.launch.submit import submit

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]
DONE = ("COMPLETED", "FAILED", "CANCELLED")


def test_submission_from_a_fresh_clone_completes(tmp_path: Path) -> None:
    """`git clone` + `miles submit` with no model prepared: the submit host creates the tiny model
    (the job's steps only read it) and the job, running the clone's code, completes."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    assert not (clone / "runs").exists()
    env = {**os.environ, "PYTHONPATH": str(clone)}  # the clone's code, on the submit host and in the job
    sets = [f"run.runs_root={tmp_path / 'runs'}", "train.steps=1"]
    out = subprocess.run(
        [sys.executable, "-m", "miles", "submit", "recipes/slurm-tiny.yaml", "--profile", "local"]
        + [a for s in sets for a in ("--set", s)],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "creating a tiny random model" in out.stderr
    run_dir = tmp_path / "runs" / "slurm-tiny"
    assert f"for {run_dir}" in out.stdout, out.stdout
    assert (clone / "runs" / "models" / "tiny" / "config.json").exists()
    assert _wait(str(run_dir), DONE, 240) == "COMPLETED", run_logs(run_dir, "actor")
    assert (run_dir / "checkpoints" / "step_1" / ".complete").exists()


def _broken_model(tiny_model: str, where: Path) -> Path:
    broken = where / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen2", "hidden_size": ')  # cut off mid-write
    return broken


def test_rollout_failing_at_start_fails_the_job_within_a_minute(tmp_path: Path, tiny_model: str) -> None:
    """The engine cannot load its model: the rollout step ends, the batch script stops the actor step
    (waiting for engines that will never come) and the job is FAILED within 60 s of submission;
    `miles status` and `miles logs` name the rollout component and show the end of its error."""
    broken = _broken_model(tiny_model, tmp_path)
    sets = [f"run.runs_root={tmp_path}", f"model.path={broken}", "model.init_tiny_if_missing=false", SELFTEST]
    run_dir = submit(TINY, "local", sets).run_dirs[0]
    assert _wait(run_dir, DONE, 60) == "FAILED"
    fail = run_status(run_dir)["failure"]
    assert fail["role"] == "rollout" and re.search(r"/logs/engine-n\d+-0\.log$", fail["log"]), fail
    assert "JSONDecodeError: Expecting value" in fail["error"].splitlines()[-1], fail
    table = format_table([run_status(run_dir)])
    assert "the rollout step failed" in table and "JSONDecodeError" in table
    logs = run_logs(run_dir)
    assert "miles: rollout step exited with 1 before the actor step; stopping the job" in logs
    # the batch log itself ends with the failed step's last lines, naming the engine and its log
    assert re.search(r"\| miles bootstrap: engine 0 on n\d+ exited with 1 before serving; see ", logs), logs
    assert "the rollout step failed" in logs and "JSONDecodeError" in logs
    assert not (Path(run_dir) / "selftest.json").exists()  # the actor never got past the engines


THREADS = re.compile(r"threads: torch intra-op (\d+) \(from ([^)]*)\)")
"""The line every torch process logs at start (the bootstrap's own line says `intra-op N for each`)."""


def test_every_process_runs_the_threads_of_its_allocation(tmp_path: Path, tiny_model: str) -> None:
    """A profile that reserves `cpus` CPUs per task and exports no OMP_NUM_THREADS: the bootstraps
    derive the thread count from SLURM_CPUS_PER_TASK, and the engine and both trainer ranks report
    that torch runs exactly that many intra-op threads (fewer than this host's cores, so a process
    that kept torch's default would show)."""
    cpus = 1 if len(os.sched_getaffinity(0)) > 1 else 2
    local = (REPO / "profiles" / "local.yaml").read_text()
    text = re.sub(r"(?m)^cpus_per_node: \d+$", f"cpus_per_node: {cpus}", local)
    assert "OMP_NUM_THREADS" not in text and f"cpus_per_node: {cpus}" in text
    prof = tmp_path / "local-cpus.yaml"
    prof.write_text(text)
    sets = [f"run.runs_root={tmp_path}", f"model.path={tiny_model}", "train.steps=1"]
    run_dir = Path(submit(TINY, str(prof), sets).run_dirs[0])
    assert _wait(str(run_dir), DONE, 240) == "COMPLETED", run_logs(run_dir, "actor")
    boot = re.findall(r"miles bootstrap: threads: torch intra-op (\d+) for each of 1 process\(es\) \(from (.*)\)",
                      run_logs(run_dir, "rollout") + run_logs(run_dir, "actor"))  # fmt: skip
    assert boot == [(str(cpus), f"SLURM_CPUS_PER_TASK={cpus}")] * 3, boot  # one rollout, two actor tasks
    engine = THREADS.findall("".join(p.read_text() for p in (run_dir / "logs").glob("engine-*.log")))
    expected = (str(cpus), f"OMP_NUM_THREADS={cpus}; the task has SLURM_CPUS_PER_TASK={cpus}")
    assert engine == [expected], f"the engine reports {engine} (set_intra_op_threads logs it at start)"
    for rank in (0, 1):  # the step's output of the rank's task and the rank's own log, whichever has it
        text = "".join(
            p.read_text()
            for name in ("actor", "trainer")
            for p in (run_dir / "logs").glob(f"{name}-{rank}.log")
        )
        reports = set(THREADS.findall(text))
        assert reports == {expected}, (
            f"trainer rank {rank} reports {reports} (set_intra_op_threads logs it at start)"
        )
