"""`miles train`: run a whole RL job on this host as child processes, then stop exactly those.

    resolve plan -> RUN_DIR/plan.yaml -> engines (+ sglang-router when more than one)
    -> publish URLs in RUN_DIR/rendezvous/ -> torchrun with train.num_ranks ranks of
    `python -m miles.loop` -> progress bar from metrics.jsonl
    -> stop everything started

Logs: RUN_DIR/logs/engine-<i>.log, router.log, trainer-<rank>.log (written by the loop),
torchrun/ (each rank's own output) and trainer-stdout.log (torchrun's). Imports no torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miles.config import ConfigError, Plan, read_plan, resolve, write_plan
from miles.config.loading import apply_overrides
from miles.processes import free_port, stop_processes

log = logging.getLogger("miles.launch")

_FRESH_START_CLEARS = (
    "checkpoints",
    "rendezvous",
    "weights",
    "tensorboard",
    "plots",
    "control",
    "metrics.jsonl",
)


def _plan(recipe: str, overrides: list[str], resume: str | None) -> Plan:
    if not resume:
        return resolve(recipe, overrides)
    stored = Path(resume) / "plan.yaml"
    if not stored.exists():
        raise ConfigError(f"--resume {resume}: {stored} does not exist; give the directory of an earlier run")
    data = apply_overrides(read_plan(stored).model_dump(mode="json"), overrides)
    return resolve(data)


def _prepare_run_dir(plan: Plan, resume: bool) -> Path:
    run_dir = Path(plan.run_dir)
    if not resume:
        for name in _FRESH_START_CLEARS:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    shutil.rmtree(run_dir / "rendezvous", ignore_errors=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_plan(plan, run_dir / "plan.yaml")
    return run_dir


def check_rollout_inputs(plan: Plan) -> None:
    """Build the task and load the reward here, so that a bad option or reward path is a ConfigError
    before any process starts (and not a traceback in the trainer's log)."""
    from miles.rollout.rewards import load_reward
    from miles.rollout.tasks import build_task

    build_task(plan.rollout.task, plan.run.seed)
    load_reward(plan.rollout.reward)


def _ensure_model(plan: Plan) -> None:
    path = Path(plan.model.path)
    if path.exists():
        return
    if not plan.model.init_tiny_if_missing:
        raise ConfigError(
            f"model.path={str(path)!r} does not exist; set model.init_tiny_if_missing=true or fix it"
        )
    from miles.models.tiny import init_tiny

    print(f"miles: creating a tiny random model at {path}", file=sys.stderr)
    init_tiny(path, seed=plan.run.seed)


def share_cpu_threads(plan: Plan) -> int | None:
    """Give each child process an equal share of this host's cores for its intra-op threads.

    Engines and trainer ranks all run torch on the same cores; each one's OpenMP pool would otherwise
    take every core, and spinning pools that oversubscribe the host slow everyone down several times.
    A value the user exported already is kept. Returns the per-process thread count set (or None).
    """
    if "OMP_NUM_THREADS" in os.environ:
        return None
    processes = plan.engine.num_engines + plan.train.num_ranks
    threads = max(1, len(os.sched_getaffinity(0)) // processes)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the children started below
    log.info("derived OMP_NUM_THREADS=%d for %d engine + trainer processes", threads, processes)
    return threads


def visible_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else every GPU NVML sees."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    from miles.cluster.hardware import probe_nvidia

    info, _ = probe_nvidia()
    return [str(i) for i in range(len(info.names))] if info else []


def gpu_placement(plan: Plan, gpus: list[str]) -> tuple[list[str | None], str | None]:
    """CUDA_VISIBLE_DEVICES of each engine and of the trainer ranks (None: leave it as it is).

    disaggregated: engines on the first `engine.num_engines` GPUs, trainer ranks on the next ones;
    colocated: engine i shares GPU i (mod the GPU count) with trainer rank i, whose LOCAL_RANK picks it.
    """
    e, t = plan.engine.num_engines, plan.train.num_ranks
    engine_gpu = plan.engine.kind == "embedded" and plan.engine.device != "cpu" and bool(gpus)
    trainer_gpu = plan.train.device != "cpu" and bool(gpus)
    if plan.launch.layout == "colocated" or not (engine_gpu and trainer_gpu):
        engines = [gpus[i % len(gpus)] if engine_gpu else None for i in range(e)]
        return engines, None
    if e + t > len(gpus):
        raise ConfigError(
            f"launch.layout=disaggregated needs engine.num_engines + train.num_ranks = {e + t} GPUs, this "
            f"host has {len(gpus)}; set launch.layout=colocated, or fewer engines or ranks"
        )
    return gpus[:e], ",".join(gpus[e : e + t])


def new_incarnation() -> str:
    """A fresh incarnation id for this start, exported to every child: rendezvous records left by any
    earlier start on this run directory are then stale (see JobEnvironment.incarnation)."""
    from miles.cluster.environment import INCARNATION_VAR

    value = f"local.{os.uname().nodename}.{os.getpid()}.{time.time_ns()}"
    os.environ[INCARNATION_VAR] = value
    return value


def start_engines(
    plan: Plan, run_dir: Path, gpus: list[str | None] | None = None, incarnation: str = "local"
) -> list[Any]:
    """Start `engine.num_engines` embedded engines (and a router) and publish their URLs."""
    from miles.cluster.rendezvous import publish_engine, publish_router
    from miles.engine.process import start_engine
    from miles.rollout.router import start_router

    e = plan.engine
    if e.kind != "embedded":
        raise ConfigError(
            "`miles train` runs the embedded engine; set engine.kind=embedded or use `miles submit`"
        )
    started: list[Any] = []
    try:
        for i in range(e.num_engines):
            eng = start_engine(
                plan.model.path,
                device=e.device,
                dtype=plan.model.dtype,
                max_running_requests=e.max_running_requests,
                max_total_tokens=e.max_total_tokens,
                seed=plan.run.seed + i,
                log_path=run_dir / "logs" / f"engine-{i}.log",
                startup_timeout_s=e.startup_timeout_s,
                env={"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus and gpus[i] is not None else None,
            )
            started.append(eng)
            publish_engine(run_dir, f"engine-{i}", eng.url, eng.pid, "local", incarnation)
        if e.num_engines > 1:
            urls = [x.url for x in started]
            router = start_router(urls, policy=e.router_policy, log_path=run_dir / "logs" / "router.log")
            started.append(router)
            publish_router(run_dir, router.url, router.pid, incarnation)
    except BaseException:
        stop_all(started)
        raise
    return started


def start_trainers(
    plan: Plan, run_dir: Path, resume: bool, gpus: str | None = None
) -> list[subprocess.Popen]:
    """torchrun with `train.num_ranks` ranks of `python -m miles.loop` (loopback, OS-chosen port).

    Each rank's output goes to RUN_DIR/logs/torchrun/; torchrun's own output to trainer-stdout.log.
    """
    n = plan.train.num_ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0",
           f"--log-dir={run_dir / 'logs' / 'torchrun'}", "--redirects=3",
           "-m", "miles.loop", "--run-dir", str(run_dir)] + (["--resume"] if resume else [])  # fmt: skip
    with open(run_dir / "logs" / "trainer-stdout.log", "ab") as out:
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {})}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return [proc]


def wait_trainers(procs: list[subprocess.Popen], poll_s: float = 0.5) -> int:
    """Wait for every rank; when one fails the others are stopped (they would hang in a collective)."""
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(poll_s)
    stop_processes(procs, 30.0)
    return next((p.returncode for p in procs if p.returncode != 0), 0)


def stop_all(procs: list[Any]) -> None:
    """Stop what we started, newest first (router before engines)."""
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as e:
            log.warning("stopping %s failed: %s", p, e)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the finally that stops children


def train_main(
    recipe: str, overrides: list[str] | None = None, resume: str | None = None, progress: bool = True
) -> int:
    """Run the job to completion on this host; returns the trainer's exit code."""
    from miles.metrics import follow_progress

    signal.signal(signal.SIGTERM, _terminate)
    plan = _plan(recipe, overrides or [], resume)
    check_rollout_inputs(plan)
    run_dir = _prepare_run_dir(plan, bool(resume))
    _ensure_model(plan)
    share_cpu_threads(plan)
    engine_gpus, trainer_gpus = gpu_placement(plan, visible_gpus())
    started = start_engines(plan, run_dir, engine_gpus, new_incarnation())
    trainers: list[subprocess.Popen] = []
    try:
        trainers = start_trainers(plan, run_dir, bool(resume), trainer_gpus)
        if progress:
            follow_progress(run_dir, plan.train.steps, lambda: all(t.poll() is None for t in trainers))
        rc = wait_trainers(trainers)
    finally:
        stop_processes(trainers, 30.0)
        stop_all(started)
    if rc != 0:
        print(f"miles: trainer exited with {rc}; see {run_dir / 'logs'}", file=sys.stderr)
    else:
        print(f"miles: run finished; metrics in {run_dir / 'metrics.jsonl'}", file=sys.stderr)
    return rc
