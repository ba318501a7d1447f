"""On the one-host Slurm dev cluster (`make slurm-up`): het jobs, arrays, cancel, requeue, MPI bootstrap,
stale rendezvous records, and jobs that fail (a hung collective, a dead engine) instead of hanging.

Each job runs real processes: the embedded engine on the rollout node, gloo trainer ranks on the
actor nodes, started by srun inside a real het job and tracked through submitit + sacct.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from miles.cluster.rendezvous import publish_engine, publish_router, read_engines
from miles.launch.status import cancel, format_table, run_logs, run_status, sweep_status
from miles.launch.submit import submit, sweep
from miles.serving import key_files, run_keys

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "slurm-tiny.yaml")
SELFTEST = "launch.actor_module=miles.cluster.selftest"


def _cluster_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm is not installed (see .ci/run)"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    idle = [s for s in out.stdout.split() if s in ("idle", "mixed", "allocated")]
    return None if out.returncode == 0 and len(idle) >= 3 else "dev cluster not up (make slurm-up)"


REASON = _cluster_up()
if REASON and os.environ.get("CI"):
    raise RuntimeError(f"CI needs the Slurm dev cluster: {REASON}")
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def _wait(run_dir: str, states: tuple[str, ...], timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        state = run_status(run_dir)["state"]
        if state.startswith(states):
            return state
        time.sleep(0.5)
    raise AssertionError(f"{run_dir}: still {state} after {timeout_s}s\n{run_logs(run_dir)}")


def _common(tmp_path: Path, tiny_model: str) -> list[str]:
    return [f"run.runs_root={tmp_path}", f"model.path={tiny_model}", SELFTEST]


def _plant_stale_records(run_dir: Path) -> str:
    """Records an earlier job left in the run directory, pointing at an address nothing serves."""
    dead = "http://127.0.0.1:9"
    publish_engine(run_dir, "n9-0", dead, 1, "n9", "999.0")
    publish_router(run_dir, dead, 1, "999.0")
    return dead


def test_het_job_engine_and_gloo_ranks(tmp_path: Path, tiny_model: str) -> None:
    dead = _plant_stale_records(tmp_path / "slurm-tiny")
    sub = submit(TINY, "local", _common(tmp_path, tiny_model))
    run_dir = Path(sub.run_dirs[0])
    assert _wait(str(run_dir), ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", run_logs(
        run_dir, "actor"
    )
    result = json.loads((run_dir / "selftest.json").read_text())
    assert result["world_size"] == 2 and result["allreduce"] == 3.0 and len(result["engines"]) == 1
    assert dead not in result["engines"]  # the stale record of job 999 was ignored
    assert [r["incarnation"] for r in read_engines(run_dir, f"{sub.job_ids[0]}.0")] == [f"{sub.job_ids[0]}.0"]
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "rendezvous" / "ranks").glob("*.json"))]
    assert {r["node"] for r in ranks} == {"n2", "n3"} or len({r["node"] for r in ranks}) == 2
    assert all(r["source"] == "slurm" and r["MASTER_ADDR"] == "127.0.0.1" for r in ranks)
    assert (run_dir / "checkpoints" / "step_2" / ".complete").exists()
    assert "actor step exited with 0" in run_logs(run_dir)
    # one intra-op thread per process, from the allocation (the profile's one CPU per task)
    assert "derived OMP_NUM_THREADS=1" in run_logs(run_dir, "actor") + run_logs(run_dir, "rollout")


THREADS = re.compile(r"threads: torch intra-op (\d+) \(from ([^)]*)\)")
"""The line every torch process logs at start (the bootstrap's own line says `intra-op N for each`)."""


def test_het_job_runs_the_rl_loop_with_the_threads_of_its_allocation(tmp_path: Path, tiny_model: str) -> None:
    """The real RL loop as a het job: it finds this job's engine (not the stale records of an earlier
    job) and trains on two actor nodes. Its profile reserves `cpus` CPUs per task and exports no
    OMP_NUM_THREADS: the bootstraps derive the thread count from SLURM_CPUS_PER_TASK, and the engine
    and both trainer ranks report that torch runs exactly that many intra-op threads (fewer than this
    host's cores, so a process that kept torch's default would show)."""
    cpus = 1 if len(os.sched_getaffinity(0)) > 1 else 2
    local = (REPO / "profiles" / "local.yaml").read_text()
    text = re.sub(r"(?m)^cpus_per_node: \d+$", f"cpus_per_node: {cpus}", local)
    assert "OMP_NUM_THREADS" not in text and f"cpus_per_node: {cpus}" in text
    prof = tmp_path / "local-cpus.yaml"
    prof.write_text(text)
    _plant_stale_records(tmp_path / "slurm-tiny")  # the loop must find this job's engine, not these
    sub = submit(TINY, str(prof), [f"run.runs_root={tmp_path}", f"model.path={tiny_model}", "train.steps=2"])
    run_dir = Path(sub.run_dirs[0])
    assert _wait(str(run_dir), ("COMPLETED", "FAILED", "CANCELLED"), 300) == "COMPLETED", run_logs(
        run_dir, "actor"
    )
    assert (run_dir / "checkpoints" / "step_2" / ".complete").exists()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in lines if "train/loss" in m][-1] == 2
    assert (
        len({json.loads(p.read_text())["node"] for p in (run_dir / "rendezvous" / "ranks").glob("*.json")})
        == 2
    )
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


def test_sweep_as_job_array(tmp_path: Path, tiny_model: str) -> None:
    common = [
        *_common(tmp_path, tiny_model),
        "launch.layout=colocated",
        "launch.actor_nodes=1",
        "train.steps=1",
    ]
    sub = sweep(TINY, "local", common, ["train.lr=0.1,0.2", "rollout.temperature=0.5,1.0"], tag="t4")
    assert len(sub.job_ids) == 4 and len({j.split("_")[0] for j in sub.job_ids}) == 1  # one array
    for run_dir in sub.run_dirs:
        assert _wait(run_dir, ("COMPLETED", "FAILED", "CANCELLED"), 180) == "COMPLETED", run_logs(
            run_dir, "actor"
        )
    rows = sweep_status(tmp_path, "t4")
    assert [r["state"] for r in rows] == ["COMPLETED"] * 4
    assert (
        all(r["metrics"]["step"] == 1 for r in rows)
        and rows[3]["point"] == "train.lr=0.2 rollout.temperature=1.0"
    )


def test_cancel(tmp_path: Path, tiny_model: str) -> None:
    sub = submit(TINY, "local", [*_common(tmp_path, tiny_model), "train.steps=200"])
    run_dir = sub.run_dirs[0]
    deadline = time.monotonic() + 120
    while not (engines := read_engines(run_dir, f"{sub.job_ids[0]}.0")):
        assert time.monotonic() < deadline, run_logs(run_dir, "rollout")
        time.sleep(0.5)
    # the job's engines take the per-job keys `miles submit` wrote (mode 600), and nothing else
    api, admin = key_files(run_dir)
    assert (api.stat().st_mode & 0o777, admin.stat().st_mode & 0o777) == (0o600, 0o600)
    url, keys = engines[0]["url"], run_keys(run_dir)
    gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(url + "/generate", json=gen, timeout=30).status_code == 401
    ok = httpx.post(url + "/generate", json=gen, headers=keys.headers("/generate"), timeout=30)
    assert ok.status_code == 200, ok.text
    flush = httpx.post(url + "/flush_cache", headers=keys.headers("/generate"), timeout=30)
    assert flush.status_code == 401  # an admin route: the admin key only
    assert cancel(run_dir) == sub.job_ids[0]
    assert _wait(run_dir, ("CANCELLED",), 60).startswith("CANCELLED")
    assert _gone(engines[0]["pid"]), "the engine outlived the cancelled job"


def _train_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m["step"] for m in rows if "train/loss" in m]


def test_requeue_resumes_the_rl_loop_from_checkpoint(tmp_path: Path, tiny_model: str) -> None:
    """USR2 before the time limit -> the real loop checkpoints -> requeue -> it resumes by itself."""
    steps = 40
    sub = submit(
        TINY, "local", [f"run.runs_root={tmp_path}", f"model.path={tiny_model}", f"train.steps={steps}"]
    )
    run_dir = Path(sub.run_dirs[0])
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or len(_train_steps(run_dir)) < 3:
        assert time.monotonic() < deadline, run_logs(run_dir, "actor")
        time.sleep(0.5)
    # what Slurm does --signal seconds before the time limit: USR2 to the batch shell only
    subprocess.run(["scancel", "--batch", "--signal=USR2", sub.job_ids[0]], check=True)
    # Slurm holds a requeued job ~120 s before it is eligible again; make it eligible now, once every
    # het component is requeued (each requeue sets that hold anew, so an earlier update is undone)
    deadline = time.monotonic() + 90
    while not _requeued_and_pending(sub.job_ids[0]):
        assert time.monotonic() < deadline, run_logs(run_dir, "actor")
        time.sleep(0.5)
    preempted_at = max(
        int(p.parent.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*/.complete")
    )
    subprocess.run(["scontrol", "update", f"JobId={sub.job_ids[0]}", "StartTime=now"], check=True)
    assert _wait(str(run_dir), ("COMPLETED", "FAILED", "CANCELLED"), 240) == "COMPLETED", run_logs(
        run_dir, "actor"
    )
    assert 3 <= preempted_at < steps
    assert _train_steps(run_dir) == list(range(1, steps + 1))  # nothing lost, nothing twice
    assert (run_dir / "checkpoints" / f"step_{steps}" / ".complete").exists()
    log = run_logs(run_dir)
    assert "USR2" in log and "start 1" in log


def _requeued_and_pending(job_id: str) -> bool:
    """Every component of the job has been requeued once and waits to start again."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    lines = out.splitlines()
    return bool(lines) and all("Restarts=1" in x and "JobState=PENDING" in x for x in lines)


def test_mpi_bootstrap_under_pmix(tmp_path: Path, tiny_model: str) -> None:
    pytest.importorskip("mpi4py")
    prof = tmp_path / "local-mpi.yaml"
    prof.write_text((REPO / "profiles" / "local.yaml").read_text() + "bootstrap: mpi\n")
    sub = submit(TINY, str(prof), _common(tmp_path, tiny_model))
    run_dir = Path(sub.run_dirs[0])
    assert _wait(str(run_dir), ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", run_logs(
        run_dir, "actor"
    )
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "rendezvous" / "ranks").glob("*.json"))]
    assert [(r["source"], r["RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("mpi", "0", "2"),
        ("mpi", "1", "2"),
    ]
    assert json.loads((run_dir / "selftest.json").read_text())["allreduce"] == 3.0


def _gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def test_hung_collective_fails_the_job_and_status_names_the_role(
    tmp_path: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 stops taking part: rank 0's collective times out after train.collective_timeout_s, its
    failure ends the actor step (--kill-on-bad-exit) and the job, and `miles status` says why."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)  # the job imports the test's actor program
    stall = ["launch.actor_module=tests.integration.collective_stall", "train.collective_timeout_s=5"]
    sub = submit(TINY, "local", [f"run.runs_root={tmp_path}", f"model.path={tiny_model}", *stall])
    run_dir = sub.run_dirs[0]
    assert _wait(run_dir, ("COMPLETED", "FAILED", "CANCELLED")) == "FAILED"
    fail = run_status(run_dir)["failure"]
    assert fail["role"] == "actor" and fail["log"].endswith("actor-0.log")
    assert "Timed out waiting 5000ms" in fail["error"], fail
    table = format_table([run_status(run_dir)])
    assert "the actor step failed" in table and fail["log"] in table and "Timed out" in table
    assert "the actor step failed" in run_logs(run_dir)
    (engine,) = read_engines(run_dir, f"{sub.job_ids[0]}.0")
    assert _gone(engine["pid"]), "the engine outlived the job"


def test_dead_engine_fails_the_job(tmp_path: Path, tiny_model: str) -> None:
    """The engine dies mid-run: the rollout step ends, the batch script stops the actor step and the
    job fails at once (not after the trainer's timeouts); `miles status` names the rollout role."""
    sub = submit(TINY, "local", [*_common(tmp_path, tiny_model), "train.steps=400"])
    run_dir = Path(sub.run_dirs[0])
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, run_logs(run_dir, "actor")
        time.sleep(0.5)
    (engine,) = read_engines(run_dir, f"{sub.job_ids[0]}.0")
    os.kill(engine["pid"], 9)
    assert _wait(str(run_dir), ("COMPLETED", "FAILED", "CANCELLED"), 60) == "FAILED"
    fail = run_status(run_dir)["failure"]
    assert fail["role"] == "rollout" and f"exited with -9; see {run_dir}/logs/engine-" in fail["error"], fail
    assert "rollout step exited with 1 before the actor step" in run_logs(run_dir)


def test_harbor_episodes_run_in_the_profiles_container_runtime(tmp_path: Path, apptainer_images: str) -> None:
    """A profile whose container.sandbox says apptainer: `miles submit` gives the run that backend and
    the job's episodes run in each task's image. The task's verifier rewards the absence of python3,
    which this host has and its image (debian:bookworm-slim) has not: reward 1 only in the container."""
    assert shutil.which("python3") is not None
    task = tmp_path / "tasks" / "in-image"
    files = {
        "task.toml": 'version = "1.0"\n[verifier]\ntimeout_sec = 60\n',
        "instruction.md": "Submit.\n",
        "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
        "tests/test.sh": "mkdir -p /logs/verifier\n"
        "if command -v python3 >/dev/null; then echo 0; else echo 1; fi > /logs/verifier/reward.txt\n",
    }
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    profile = tmp_path / "local-apptainer.yaml"
    profile.write_text(
        (REPO / "profiles" / "local.yaml").read_text()
        + f"container:\n  sandbox: {{runtime: apptainer, image_dir: {apptainer_images}}}\n"
    )
    overrides = [f"run.runs_root={tmp_path}", f"model.path={tmp_path / 'model'}", "model.tiny.pretrain_steps=0",
                 "rollout.env.options.generate=false", f"rollout.env.options.tasks={tmp_path / 'tasks'}",
                 "rollout.env.demonstrations=0", "train.steps=2", "eval.every_steps=0",
                 "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"]  # fmt: skip
    sub = submit(str(REPO / "recipes" / "coding-tiny.yaml"), str(profile), overrides)
    run_dir = Path(sub.run_dirs[0])
    assert "runtime: apptainer" in (run_dir / "plan.yaml").read_text()
    assert _wait(str(run_dir), ("COMPLETED", "FAILED", "CANCELLED"), 300) == "COMPLETED", run_logs(run_dir)
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [m["rollout/reward_mean"] for m in steps if "rollout/reward_mean" in m]
    assert rewards and all(r == 1.0 for r in rewards), rewards
    assert all(m.get("rollout/masked_samples", 0) == 0 for m in steps)
