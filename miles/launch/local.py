"""`miles train`: run a whole RL job on this host as child processes, then stop exactly those.

    resolve plan -> RUN_DIR/plan.yaml -> engines (+ sglang-router when more than one)
    -> publish URLs in RUN_DIR/rendezvous/ -> torchrun with train.num_ranks ranks of
    `python -m miles.loop` -> progress bar from metrics.jsonl
    -> stop everything started

With `engine.urls` no engine is started: the servers there are checked and published instead
(miles.launch.external), put behind a router of ours when more than one, and left running at the end.

Logs: RUN_DIR/logs/engine-<i>.log, router.log, trainer-<rank>.log (written by the loop),
torchrun/ (each rank's own output) and trainer-stdout.log (torchrun's). Imports no torch.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miles.config import ConfigError, Plan, read_plan, resolve, write_plan
from miles.config.engine import check_external_engines
from miles.config.loading import apply_overrides
from miles.launch.diskspace import full_file_system, write_elsewhere
from miles.launch.external import check_external_servers, publish_external
from miles.launch.prepare import check_teacher_model, ensure_model
from miles.launch.rundir import RunDirLock, prepare_run_dir
from miles.launch.supervise import EngineSlot, RunFailed, Supervisor, trainer_error
from miles.loop.inputs import check_inputs
from miles.metrics import ProgressBar
from miles.processes import child_options, free_port, stop_processes
from miles.rollout.engine_argv import engine_argv
from miles.serving import key_arguments, make_run_keys, run_keys

log = logging.getLogger("miles.launch")


def _plan(recipe: str, overrides: list[str], resume: str | None) -> Plan:
    if not resume:
        return resolve(recipe, overrides)
    stored = Path(resume) / "plan.yaml"
    if not stored.exists():
        raise ConfigError(f"--resume {resume}: {stored} does not exist; give the directory of an earlier run")
    data = apply_overrides(read_plan(stored).model_dump(mode="json"), overrides)
    return resolve(data)


def _prepare_run_dir(plan: Plan, resume: bool, overwrite: bool) -> Path:
    """Refuse to reuse an earlier run's directory unless told how (see miles.launch.rundir); with
    --resume, refuse when no checkpoint verifies (damaged newer ones are reported and skipped)."""
    from miles.train.checkpoint import find_resume_step

    run_dir = Path(plan.run_dir)
    if resume:
        step, damaged = find_resume_step(run_dir)
        for message in damaged:
            print(f"miles: {message}", file=sys.stderr)
        if step is None:
            raise ConfigError(
                f"--resume {run_dir}: no complete checkpoint verifies in {run_dir / 'checkpoints'}; "
                "start without --resume (with --overwrite to discard the earlier run)"
            )
    for removed in prepare_run_dir(run_dir, resume=resume, overwrite=overwrite):
        if overwrite:  # a plain start only clears leftovers that hold no data (rendezvous/, control/)
            print(f"miles: --overwrite: removed {removed}", file=sys.stderr)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    make_run_keys(run_dir)  # the run's servers take these keys and its clients send them
    write_plan(plan, run_dir / "plan.yaml")
    return run_dir


def eval_cores(plan: Plan) -> set[int]:
    """Cores kept for the dedicated eval engines (eval.cpus), checked against this process's cores."""
    if not (plan.eval.cpus and plan.eval.mode == "dedicated" and plan.eval.every_steps):
        return set()
    mine, wanted = os.sched_getaffinity(0), set(plan.eval.cpus)
    if not wanted <= mine:
        raise ConfigError(
            f"eval.cpus {sorted(wanted)}: cores {sorted(wanted - mine)} are not this process's "
            f"(it may run on {sorted(mine)}); pick eval.cpus among those"
        )
    if not mine - wanted:
        raise ConfigError(
            f"eval.cpus {sorted(wanted)} takes every core this process has: leave one for training"
        )
    return wanted


def reserve_eval_cores(plan: Plan) -> None:
    """Keep this process (and so the rollout engines and trainer ranks it starts) off eval.cpus."""
    if cores := eval_cores(plan):
        training = os.sched_getaffinity(0) - cores
        os.sched_setaffinity(0, training)
        log.info("eval engines on cores %s, training on cores %s", sorted(cores), sorted(training))


def share_cpu_threads(plan: Plan) -> int | None:
    """Give each child process an equal share of this host's cores for its intra-op threads.

    Engines and trainer ranks all run torch on the same cores; each one's OpenMP pool would otherwise
    take every core, and spinning pools that oversubscribe the host slow everyone down several times.
    A value the user exported already is kept. Eval engines on cores of their own (eval.cpus) are
    not counted: they take one thread per core they have. Returns the per-process thread count set
    (or None).
    """
    if "OMP_NUM_THREADS" in os.environ:
        return None
    shared = plan.eval.mode == "dedicated" and plan.eval.every_steps and not plan.eval.cpus
    evals = plan.eval.num_engines if shared else 0
    processes = engines_started_here(plan) + plan.train.num_ranks + evals
    threads = max(1, len(os.sched_getaffinity(0)) // processes)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the children started below
    log.info("derived OMP_NUM_THREADS=%d for %d engine + trainer + eval engine processes", threads, processes)
    return threads


def engines_started_here(plan: Plan) -> int:
    """Engine processes `miles train` starts: none when engine.urls names running servers."""
    return 0 if plan.engine.urls else plan.engine.num_engines


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
    e, t = engines_started_here(plan), plan.train.num_ranks
    engine_gpu = e > 0 and plan.engine.kind == "embedded" and plan.engine.device != "cpu" and bool(gpus)
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


def start_engine_process(plan: Plan, run_dir: Path, i: int, gpu: str | None, incarnation: str) -> Any:
    """Start engine i (the embedded engine, its log in RUN_DIR/logs/engine-<i>.log) and publish it."""
    from miles.cluster.rendezvous import publish_engine
    from miles.engine.process import start_engine

    e = plan.engine
    eng = start_engine(
        plan.model.path,
        device=e.device,
        dtype=plan.model.dtype,
        max_running_requests=e.max_running_requests,
        max_total_tokens=e.max_total_tokens,
        seed=plan.run.seed + i,
        log_path=run_dir / "logs" / f"engine-{i}.log",
        startup_timeout_s=e.startup_timeout_s,
        env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None,
        extra_args=(["--enable-fault-injection"] if e.fault_injection else [])
        + (["--enable-return-routed-experts"] if plan.train.routing_replay == "rollout" else [])
        + engine_argv(plan)
        + key_arguments(run_dir),
    )
    publish_engine(run_dir, f"engine-{i}", eng.url, eng.pid, "local", incarnation)
    return eng


def start_teacher(plan: Plan, run_dir: Path, gpu: str | None, incarnation: str) -> Any:
    """The embedded engine serving train.distill.teacher_model (log RUN_DIR/logs/teacher-0.log),
    published in the rendezvous' teachers folder; None when the plan has no such teacher."""
    from miles.cluster.rendezvous import TEACHERS, publish_engine
    from miles.engine.process import start_engine

    d, e = plan.train.distill, plan.engine
    if d is None or not d.teacher_model:
        return None
    eng = start_engine(
        d.teacher_model,
        device=e.device,
        dtype=plan.model.dtype,
        max_running_requests=e.max_running_requests,
        max_total_tokens=e.max_total_tokens,
        seed=plan.run.seed,
        log_path=run_dir / "logs" / "teacher-0.log",
        startup_timeout_s=e.startup_timeout_s,
        env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None,
        extra_args=key_arguments(run_dir),
    )
    publish_engine(run_dir, "teacher-0", eng.url, eng.pid, "local", incarnation, TEACHERS)
    return eng


def start_engines(
    plan: Plan, run_dir: Path, gpus: list[str | None] | None = None, incarnation: str = "local"
) -> tuple[list[EngineSlot], Any]:
    """Start `engine.num_engines` embedded engines, or publish the servers of `engine.urls`, then a
    router in front when there is more than one; returns (engine slots, the router or None)."""
    from miles.cluster.rendezvous import publish_router
    from miles.rollout.router import start_router

    e = plan.engine
    if e.kind != "embedded" and not e.urls:
        raise ConfigError(
            "`miles train` runs the embedded engine; set engine.kind=embedded, point engine.urls at running "
            "SGLang servers, or use `miles submit`"
        )
    slots = [
        EngineSlot(i, x, external=True) for i, x in enumerate(publish_external(run_dir, e.urls, incarnation))
    ]
    router = None
    try:
        for i in range(engines_started_here(plan)):
            slots.append(
                EngineSlot(i, start_engine_process(plan, run_dir, i, gpus[i] if gpus else None, incarnation))
            )
        if len(slots) > 1:
            urls = [s.proc.url for s in slots]
            # the router sends its key to every worker: only when all of them are this run's engines
            key = None if e.urls else run_keys(run_dir).api
            router = start_router(
                urls, policy=e.router_policy, log_path=run_dir / "logs" / "router.log", api_key=key
            )
            publish_router(run_dir, router.url, router.pid, incarnation)
    except BaseException:
        stop_all(ours(slots, router))
        raise
    return slots, router


def ours(slots: list[EngineSlot], router: Any) -> list[Any]:
    """The processes this launcher started, router last: every engine but the servers of engine.urls."""
    return [s.proc for s in slots if not s.external] + ([router] if router is not None else [])


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
        # SIGTERM when we die, however: torchrun then stops its ranks (each also dies with torchrun)
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            **child_options(signal.SIGTERM),
        )  # fmt: skip
    return [proc]


def stop_all(procs: list[Any]) -> None:
    """Stop what we started, newest first (router before engines)."""
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as e:
            log.warning("stopping %s failed: %s", p, e)


def train_main(
    recipe: str,
    overrides: list[str] | None = None,
    resume: str | None = None,
    progress: bool = True,
    *,
    overwrite: bool = False,
) -> int:
    """Run the job to completion on this host, holding the run directory's lock; returns the exit
    status for the console."""
    started = time.monotonic()
    plan = _plan(recipe, overrides or [], resume)
    check_external_engines(plan)
    check_inputs(plan)
    with RunDirLock.acquire(plan.run_dir):
        run_dir = _prepare_run_dir(plan, bool(resume), overwrite)
        ensure_model(plan, train_base=True)
        check_teacher_model(plan)
        if plan.engine.urls:
            check_external_servers(plan, bool(resume))
        reserve_eval_cores(plan)
        share_cpu_threads(plan)
        return _run(plan, recipe, run_dir, bool(resume), progress, started)


def _run(plan: Plan, recipe: str, run_dir: Path, resume: bool, progress: bool, started: float) -> int:
    """Engines, then trainer ranks under supervision; everything started is stopped at the end."""
    engine_gpus, trainer_gpus = gpu_placement(plan, visible_gpus())
    incarnation = new_incarnation()
    sup: Supervisor | None = None
    slots: list[EngineSlot] = []
    router: Any = None
    trainers: list[subprocess.Popen] = []
    teacher: Any = None
    old_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        slots, router = start_engines(plan, run_dir, engine_gpus, incarnation)
        teacher = start_teacher(plan, run_dir, engine_gpus[0] if engine_gpus else None, incarnation)

        def restart(i: int) -> Any:
            return start_engine_process(plan, run_dir, i, engine_gpus[i], incarnation)

        sup = Supervisor(plan, run_dir, slots, restart, router)
        for s in old_handlers:
            signal.signal(s, sup.on_signal)
        trainers = start_trainers(plan, run_dir, resume, trainer_gpus)
        bar = ProgressBar(run_dir, plan.train.steps) if progress else None
        try:
            rc = sup.watch(trainers, bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
    except RunFailed as e:
        print(f"miles: {e}", file=sys.stderr)
        rc = 1
    finally:
        stop_processes(trainers, 30.0)
        stop_all(ours(slots, router) + ([teacher] if teacher is not None else []))
        # (the supervisor swaps replacements into the slots)
        for s, h in old_handlers.items():
            signal.signal(s, h)
    return _report(recipe, run_dir, rc, sup.interrupted if sup else None, started)


def _summary(run_dir: Path, started: float) -> str:
    """` in W min; held-out eval/pass@1 A (step a) -> B (step b)` of a finished run (no eval: the time)."""
    from miles.metrics import eval_progress, read_metrics

    progress = eval_progress(read_metrics(run_dir))
    return f" in {(time.monotonic() - started) / 60:.1f} min" + (f"; {progress}" if progress else "")


def _report(recipe: str, run_dir: Path, rc: int, interrupted: int | None, started: float) -> int:
    """One closing message on the console; the exit status (128 + signal when interrupted)."""
    from miles.train.checkpoint import latest_complete_step

    step = latest_complete_step(run_dir)
    resume = shlex.join(["miles", "train", recipe, "--resume", str(run_dir)])
    if interrupted is not None:
        name = signal.Signals(interrupted).name
        saved = f"checkpoint of step {step} in {run_dir / 'checkpoints'}" if step else "no checkpoint yet"
        print(f"miles: stopped by {name} ({saved}); continue with: {resume}", file=sys.stderr)
        return 128 + interrupted
    if rc == 0:
        print(
            f"miles: run finished{_summary(run_dir, started)}; metrics in {run_dir / 'metrics.jsonl'}",
            file=sys.stderr,
        )
        return 0
    try:
        error, path = trainer_error(run_dir)
    except OSError as e:
        error, path = f"(its logs cannot be read: {e})", run_dir / "logs"
    full = full_file_system(run_dir, error)
    if full is not None:  # the run's own logs may be cut: say it here, and in a log elsewhere
        report = f"miles: {full}\nthe trainer's last error ({path}):\n{error}\n"
        spare = write_elsewhere(run_dir, report)
        print(f"miles: {full}" + (f" (this report is also in {spare})" if spare else ""), file=sys.stderr)
    print(f"miles: trainer failed (exit {rc}); its log {path} ends with:", file=sys.stderr)
    print("\n".join(f"    {line}" for line in error.splitlines()), file=sys.stderr)
    if step:
        print(f"miles: the last checkpoint is step {step}; continue with: {resume}", file=sys.stderr)
    return rc
