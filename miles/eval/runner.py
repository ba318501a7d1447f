"""Runners of snapshot evaluations, off the training thread, and the by-hand entry point.

- ExternalRunner: one child process per evaluation, `python -m miles.eval.runner external ...`,
  which imports `eval.external_fn`, calls it with the snapshot directory and writes
  RUN_DIR/eval/step_N/result.json ({"ok": true, "metrics": {...}} or {"ok": false, "error": ...}).
  A child that exits without a result crashed (eval/skipped_crash); one that outlives
  eval.timeout_s is stopped (eval/skipped_timeout). Its output: RUN_DIR/eval/step_N/external.log.
- DedicatedRunner: eval engines of their own, behind the eval driver, a process of its own
  (`python -m miles.eval.runner driver`) that runs an EvalService and takes one job line per
  evaluation on its stdin, answering with the same result.json. Under `miles train` (and in a
  Slurm job without an eval group) the driver starts `eval.num_engines` embedded engines on this
  host (logs RUN_DIR/logs/eval-engine-<i>.log) and restarts one that died; in a Slurm job with a
  third het group (the eval group) it uses the engines that group published in
  RUN_DIR/rendezvous/eval_engines/*.json. Evaluations run one at a time: each loads its snapshot
  into every eval engine (`/update_weights_from_disk`, weight version = step), then evaluates.

`python -m miles.eval.runner snapshot --run-dir D --step N` evaluates one snapshot by hand (the
mode of the run's plan; `shared` runs dedicated) and prints the metrics; `miles eval` calls it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.cluster.environment import JobEnvironment
from miles.cluster.rendezvous import write_atomic
from miles.config import ConfigError, Plan, read_plan
from miles.config.plugins import load_function
from miles.eval.modes import (
    SKIP_REASONS,
    CountingGenerator,
    EvalJob,
    EvalSkipped,
    Evaluations,
    evaluate_step,
)
from miles.eval.snapshot import eval_dir, find_snapshot, snapshot_from_checkpoint
from miles.processes import child_options, free_port, stop_processes
from miles.rollout.engine_argv import engine_argv
from miles.serving import key_arguments, run_keys, sglang_key_arguments

log = logging.getLogger("miles.eval")

RESULT = "result.json"


def load_external(spec: str) -> Callable[[str], dict[str, Any]]:
    """`module:function` or `module.function` -> the function; errors name eval.external_fn."""
    if ":" not in spec and "." in spec:
        spec = ":".join(spec.rsplit(".", 1))
    return load_function(spec, "eval.external_fn")


def _module_exists(name: str) -> bool:
    try:
        return bool(name) and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def eval_metrics(raw: Any, spec: str) -> dict[str, float]:
    """An external function's answer as eval/* metrics (keys without a group go under eval/)."""
    if not isinstance(raw, dict):
        raise TypeError(f"eval.external_fn={spec!r} returned {type(raw).__name__}, not a dict of metrics")
    out = {}
    for key, value in raw.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key if "/" in key else f"eval/{key}"] = float(value)
    return out


def run_external(spec: str, snapshot: Path) -> dict[str, float]:
    """Call the external function on a complete snapshot (in this process) and time it."""
    start = time.monotonic()
    metrics = eval_metrics(load_external(spec)(str(snapshot)), spec)
    metrics.setdefault("eval/duration_s", time.monotonic() - start)
    return metrics


class ExternalRunner:
    """`external` mode: one child process per evaluation (see the module docstring)."""

    def __init__(self, plan: Plan, run_dir: Path) -> None:
        self.spec = str(plan.eval.external_fn)
        module = self.spec.partition(":")[0] if ":" in self.spec else self.spec.rpartition(".")[0]
        if not _module_exists(module):  # found before training starts, not at step N
            raise ConfigError(f"eval.external_fn={self.spec!r}: no module {module!r} on the Python path")
        self.timeout_s = plan.eval.timeout_s
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, job: EvalJob) -> None:
        (job.out_dir / RESULT).unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "miles.eval.runner", "external", "--fn", self.spec]
        cmd += ["--snapshot", str(job.snapshot), "--out", str(job.out_dir / RESULT)]
        with open(job.out_dir / "external.log", "ab") as out:
            job.handle = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **child_options()
            )
        self.procs.append(job.handle)
        job.started = time.monotonic()

    def poll(self, job: EvalJob) -> dict[str, float] | None:
        proc: subprocess.Popen = job.handle
        if proc.poll() is None:
            if time.monotonic() - job.started <= self.timeout_s:
                return None
            stop_processes([proc], 10.0)
            raise EvalSkipped("timeout", f"still running after eval.timeout_s={self.timeout_s:.0f}s")
        self.procs.remove(proc)
        if not (job.out_dir / RESULT).exists():
            raise EvalSkipped(
                "crash", f"exit status {proc.returncode}, no result; see {job.out_dir / 'external.log'}"
            )
        return read_result(job.out_dir / RESULT)

    def stop(self) -> None:
        stop_processes(self.procs, 10.0)
        self.procs.clear()


def published_eval_engines(run_dir: Path, incarnation: str) -> list[str]:
    """URLs the eval group of this incarnation published (RUN_DIR/rendezvous/eval_engines/*.json,
    written by `python -m miles.cluster.bootstrap eval`)."""
    from miles.cluster.rendezvous import EVAL_ENGINES, read_engines

    return [rec["url"] for rec in read_engines(run_dir, incarnation, EVAL_ENGINES)]


def has_eval_group(env: JobEnvironment) -> bool:
    """A Slurm job with a third het group, the eval group, whose engines are published."""
    return len(env.het_nodes) > 2


class EvalService:
    """The eval engines and the evaluation of one snapshot at a time on all of them (module docstring).

    It runs in the eval driver process (DedicatedRunner) under `miles train`, or in `miles eval`'s own
    process for a by-hand evaluation. Its coroutines run on one event loop; engines are started from
    that loop's thread, and live as long as it does (their parent-death signal)."""

    def __init__(self, plan: Plan, run_dir: Path) -> None:
        env = JobEnvironment.from_env()
        self.plan, self.run_dir = plan, run_dir
        self.incarnation = env.incarnation
        self.published = has_eval_group(env)
        """The job has an eval group whose engines are published (else we start our own)."""
        self.engines: list[Any] = []
        """EngineProcess of each engine we started (empty when they are published)."""
        self.generator: CountingGenerator | None = None
        self.urls: list[str] = []
        """URLs of the connected eval engines."""
        self._parts: asyncio.Future | None = None
        """The load of the datasets, encoder and reward (`_loading_parts`)."""

    async def start_early(self) -> None:
        """Start (or find) the eval engines now, while training starts, not at the first evaluation
        (the datasets and tokenizer load meanwhile)."""
        start = time.monotonic()
        self._loading_parts()
        try:
            await self._ensure_engines()
            log.info("eval engines %s ready in %.1fs", self.urls, time.monotonic() - start)
        except Exception as e:
            log.warning("eval engines not ready (retried at the first evaluation): %s", e)

    async def evaluate(self, step: int, snapshot: Path) -> dict[str, float]:
        """Load the snapshot of `step` into every eval engine, evaluate, check the versions; raises
        EvalSkipped (only) when there is no result."""
        try:
            await self._ensure_engines()
        except Exception as e:
            raise EvalSkipped("engine_lost", f"no eval engine: {e}") from None
        start = time.monotonic()
        try:
            metrics = await asyncio.wait_for(self._run(step, snapshot), self.plan.eval.timeout_s)
        except TimeoutError:
            raise EvalSkipped("timeout", f"over eval.timeout_s={self.plan.eval.timeout_s:.0f}s") from None
        except Exception as e:
            reason = "engine_lost" if self._lost() else "error"
            raise EvalSkipped(reason, f"{type(e).__name__}: {e}") from None
        metrics["eval/duration_s"] = time.monotonic() - start
        return metrics

    async def _run(self, step: int, snapshot: Path) -> dict[str, float]:
        assert self.generator is not None
        admins = self.generator.clients
        await asyncio.gather(
            *(a.update_weights_from_disk(str(snapshot), weight_version=str(step)) for a in admins)
        )
        return await evaluate_step(self.generator, self.suites, step, self.run_dir / "eval")

    async def _ensure_engines(self) -> None:
        """Start (or find) the eval engines when none is connected or one we started has died."""
        if self.generator is not None and all(x.alive() for x in self.engines):
            return
        await self._close_clients()
        self.stop_engines()
        if self.published:
            urls = await asyncio.to_thread(self._wait_published)
        else:
            self.engines = [self._start_engine(i) for i in range(self.plan.eval.num_engines)]
            urls = [x.url for x in self.engines]
        await self._connect(urls)

    def _start_engine(self, i: int) -> Any:
        from miles.engine.process import start_engine

        e, m = self.plan.engine, self.plan.model
        if e.kind == "sglang":
            return self._start_sglang(i)
        cpus = set(self.plan.eval.cpus)  # cores of their own: one intra-op thread per core
        return start_engine(
            m.path,
            device=e.device,
            dtype=m.dtype,
            max_running_requests=e.max_running_requests,
            max_total_tokens=e.max_total_tokens,
            seed=self.plan.run.seed + 1000 + i,
            log_path=self.run_dir / "logs" / f"eval-engine-{i}.log",
            startup_timeout_s=e.startup_timeout_s,
            extra_args=engine_argv(self.plan) + key_arguments(self.run_dir),
            env={"OMP_NUM_THREADS": str(len(cpus))} if cpus else None,
            cpus=cpus or None,
        )

    def _start_sglang(self, i: int) -> Any:
        """SGLang server i on this node (GPUs i*tp_size...), the command the rollout nodes run."""
        from miles.cluster.rendezvous import healthy
        from miles.engine.process import EngineProcess, log_tail
        from miles.rollout.sglang import sglang_server_command

        port, log_path = free_port(), self.run_dir / "logs" / f"eval-engine-{i}.log"
        argv = sglang_server_command(
            self.plan,
            host="127.0.0.1",
            port=port,
            python=sys.executable,
            base_gpu_id=i * self.plan.engine.tp_size,
        )
        argv += sglang_key_arguments(self.run_dir)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **child_options())
        engine = EngineProcess(f"http://127.0.0.1:{port}", proc, log_path)
        deadline = time.monotonic() + self.plan.engine.startup_timeout_s
        while not healthy(engine.url):
            if not engine.alive() or time.monotonic() > deadline:
                engine.stop()
                raise RuntimeError(
                    f"eval SGLang server {i} did not serve; log {log_path}:\n{log_tail(log_path)}"
                )
            time.sleep(1.0)
        return engine

    def _lost(self) -> bool:
        """An engine we started has died, or a published one (the eval group's) no longer answers."""
        if self.published:
            from miles.cluster.rendezvous import healthy

            return not all(healthy(u) for u in self.urls)
        return any(not x.alive() for x in self.engines)

    def _wait_published(self) -> list[str]:
        from miles.cluster.rendezvous import healthy

        deadline = time.monotonic() + self.plan.engine.startup_timeout_s
        while time.monotonic() < deadline:
            urls = published_eval_engines(self.run_dir, self.incarnation)
            if urls and all(healthy(u) for u in urls):
                return urls
            time.sleep(1.0)
        raise TimeoutError(
            f"no healthy eval engine of incarnation {self.incarnation!r} published in "
            f"{self.run_dir / 'rendezvous' / 'eval_engines'} within engine.startup_timeout_s"
        )

    def _loading_parts(self) -> asyncio.Future:
        """The load of the datasets, encoder and reward, started in a worker thread on first call."""
        if self._parts is None:
            self._parts = asyncio.get_running_loop().run_in_executor(None, self._load_parts)
        return self._parts

    def _load_parts(self) -> None:
        """The eval datasets, the prompt encoder (tokenizer) and the reward; loaded once, in a worker
        thread while the engines start."""
        from miles.eval.datasets import build_suites
        from miles.rollout.generate import PromptEncoder
        from miles.rollout.rewards import load_reward
        from miles.rollout.tasks import plan_task

        start, r = time.monotonic(), self.plan.rollout
        self.suites = build_suites(self.plan, plan_task(self.plan))
        self.encoder = PromptEncoder(self.plan.model.path)
        self.reward = load_reward(r.reward)
        log.info("eval datasets, tokenizer and reward loaded in %.1fs", time.monotonic() - start)

    async def _connect(self, urls: list[str]) -> None:
        from miles.rollout.client import SGLangClient

        await self._loading_parts()
        r = self.plan.rollout
        self.urls = list(urls)
        keys = run_keys(self.run_dir)
        clients = [SGLangClient(u, max_connections=r.max_concurrency_per_engine + 8, keys=keys) for u in urls]
        self.generator = CountingGenerator.from_config(clients, self.encoder, self.reward, r)

    async def _close_clients(self) -> None:
        if self.generator is not None:
            await asyncio.gather(*(c.aclose() for c in self.generator.clients), return_exceptions=True)

    def stop_engines(self) -> None:
        stop_processes([x.proc for x in self.engines], 10.0)
        self.engines = []

    async def close(self) -> None:
        await self._close_clients()
        self.stop_engines()


DRIVER_STATE = "eval-driver.json"
"""RUN_DIR/logs/eval-driver.json: the eval driver's pid and its engines (url, pid), once they serve."""


class DedicatedRunner:
    """`dedicated` mode, on trainer rank 0: the eval driver, a process of its own
    (`python -m miles.eval.runner driver`, log RUN_DIR/logs/eval-driver.log) that runs an EvalService.

    The driver gets one JSON line per evaluation on its stdin and writes the job's result.json
    (RUN_DIR/eval/step_N/, as an external evaluation does). Requests, tokenising, scoring and the
    per-sample JSONL are its work, under its own interpreter lock, so none of it competes with the
    training loop of this process; with eval.cpus it runs on those cores with its engines. A driver
    that dies fails its evaluations in flight (`crash`) and is started again for the next one."""

    def __init__(self, plan: Plan, run_dir: Path) -> None:
        from miles.config import write_plan

        self.plan, self.run_dir = plan, run_dir
        self.plan_path = run_dir / "eval" / "driver-plan.yaml"
        write_plan(plan, self.plan_path)
        self.log_path = run_dir / "logs" / "eval-driver.log"
        self.proc: subprocess.Popen | None = None
        self._launch()  # its engines start while training does

    def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "miles.eval.runner", "driver", "--run-dir", str(self.run_dir)]
        cmd += ["--plan", str(self.plan_path)]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                **child_options(signal.SIGTERM),  # it stops its engines on the way out
            )
        if (cpus := set(self.plan.eval.cpus)) and not has_eval_group(JobEnvironment.from_env()):
            os.sched_setaffinity(self.proc.pid, cpus)  # with the engines it starts

    def start(self, job: EvalJob) -> None:
        (job.out_dir / RESULT).unlink(missing_ok=True)
        if self.proc is None or self.proc.poll() is not None:
            log.warning(
                "eval driver not running (exit %s): starting it again", self.proc and self.proc.returncode
            )
            self._launch()
        assert self.proc is not None and self.proc.stdin is not None
        line = json.dumps({"step": job.step, "snapshot": str(job.snapshot), "out": str(job.out_dir / RESULT)})
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as e:  # it died since the check above
            raise EvalSkipped("crash", f"eval driver gone ({e}); see {self.log_path}") from None
        job.handle = self.proc

    def poll(self, job: EvalJob) -> dict[str, float] | None:
        path = job.out_dir / RESULT
        if not path.exists():
            if job.handle.poll() is None:
                return None
            if not path.exists():  # not written just before it exited
                raise EvalSkipped(
                    "crash", f"eval driver exited ({job.handle.returncode}) first; see {self.log_path}"
                )
        return read_result(path)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # an idle driver exits at once
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            stop_processes([self.proc], 20.0)  # SIGTERM: it stops its engines, then exits
        self.proc = None


def read_result(path: Path) -> dict[str, float]:
    """The metrics of a result.json, or EvalSkipped with its reason and the last line of its error."""
    result = json.loads(path.read_text())
    if not result.get("ok"):
        lines = str(result.get("error", "")).strip().splitlines()
        reason = result.get("reason", "error")
        raise EvalSkipped(reason if reason in SKIP_REASONS else "error", lines[-1] if lines else str(path))
    return {k: float(v) for k, v in result["metrics"].items()}


def _driver_main(args: argparse.Namespace) -> int:
    """The eval driver: start the engines, then evaluate each job line of stdin until it closes."""
    run_dir = Path(args.run_dir)
    service = EvalService(read_plan(args.plan), run_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through `finally`: engines stopped
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(service.start_early())
        write_atomic(run_dir / "logs" / DRIVER_STATE, state := _driver_state(service))
        while line := sys.stdin.readline():
            job = json.loads(line)
            try:
                result = {
                    "ok": True,
                    "metrics": loop.run_until_complete(service.evaluate(job["step"], Path(job["snapshot"]))),
                }
            except EvalSkipped as e:
                log.warning("evaluation of step %s skipped (%s)", job["step"], e)
                result = {"ok": False, "reason": e.reason, "error": e.detail}
            write_atomic(Path(job["out"]), result)
            if (now := _driver_state(service)) != state:  # its engines were started again
                write_atomic(run_dir / "logs" / DRIVER_STATE, state := now)
        loop.run_until_complete(service.close())  # stdin closed: the run is over
    finally:
        service.stop_engines()  # also on SIGTERM
    return 0


def _driver_state(service: EvalService) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "engines": [{"url": x.url, "pid": x.proc.pid} for x in service.engines],
        "urls": service.urls,
    }


RUNNERS: dict[str, Callable[[Plan, Path], Any]] = {"dedicated": DedicatedRunner, "external": ExternalRunner}


def evaluations(plan: Plan, run_dir: Path) -> Evaluations | None:
    """The bookkeeping of this plan's evaluation mode with its runner; None for `shared` mode or
    evaluation turned off."""
    if plan.eval.mode == "shared" or plan.eval.every_steps <= 0:
        return None
    return Evaluations(plan, run_dir, RUNNERS[plan.eval.mode](plan, run_dir))


"""The runner of each snapshot mode (`shared` evaluates on the rollout engines, in the loop)."""


def evaluate_snapshot(run_dir: Path, step: int, mode: str | None = None, fn: str | None = None) -> dict:
    """Evaluate the complete snapshot of `step` of a run by hand, in this process (external) or on
    an eval engine started here (dedicated); the run's plan gives every other setting."""
    plan = read_plan(run_dir / "plan.yaml")
    mode = "external" if fn else (mode or plan.eval.mode)
    mode = "dedicated" if mode == "shared" else mode
    updates = {"mode": mode, **({"external_fn": fn} if fn else {})}
    plan = plan.model_copy(update={"eval": plan.eval.model_copy(update=updates)})
    if mode == "external" and not plan.eval.external_fn:
        raise ConfigError(f"{run_dir}: eval.external_fn is not set in its plan; pass --fn module:function")
    try:
        snapshot = find_snapshot(run_dir, step)
    except FileNotFoundError:  # a checkpointed step: its weights exported for evaluation first
        snapshot = snapshot_from_checkpoint(run_dir, step)
    if mode == "external":
        return run_external(str(plan.eval.external_fn), snapshot)
    return asyncio.run(_evaluate_once(EvalService(plan, run_dir), step, snapshot))


async def _evaluate_once(service: EvalService, step: int, snapshot: Path) -> dict[str, float]:
    try:
        return await service.evaluate(step, snapshot)
    finally:
        await service.close()


def _external_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        metrics = run_external(args.fn, Path(args.snapshot))
    except Exception as e:
        traceback.print_exc()
        write_atomic(out, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    write_atomic(out, {"ok": True, "metrics": metrics})
    return 0


def snapshot_main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    try:
        metrics = evaluate_snapshot(run_dir, args.step, args.mode, args.fn)
    except (ConfigError, FileNotFoundError, EvalSkipped) as e:
        print(f"miles eval: {e}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else eval_dir(run_dir, args.step) / "manual.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, {"ok": True, "step": args.step, "metrics": metrics})
    print(json.dumps(metrics, indent=1, sort_keys=True))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.eval.runner", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("external", help="call an external eval function on a snapshot (one evaluation)")
    q.add_argument("--fn", required=True, help="module:function")
    q.add_argument("--snapshot", required=True, help="a complete snapshot directory")
    q.add_argument("--out", required=True, help="where to write the result JSON")
    q.set_defaults(func=_external_main)
    q = sub.add_parser(
        "driver", help="the eval driver of a run in dedicated mode (started by trainer rank 0)"
    )
    q.add_argument("--run-dir", required=True, help="the run directory")
    q.add_argument("--plan", required=True, help="the plan to evaluate with (plan.yaml form)")
    q.set_defaults(func=_driver_main)
    q = sub.add_parser("snapshot", help="evaluate the snapshot of one step of a run")
    add_snapshot_args(q)
    q.set_defaults(func=snapshot_main)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args.func(args))


def add_snapshot_args(q: argparse.ArgumentParser) -> None:
    """The arguments of a by-hand evaluation (shared with `miles eval`)."""
    q.add_argument("--run-dir", required=True, help="the run directory")
    q.add_argument("--step", type=int, required=True, help="the step whose snapshot to evaluate")
    q.add_argument("--mode", choices=["dedicated", "external"], help="default: the run's eval.mode")
    q.add_argument("--fn", help="an external eval function (module:function); implies --mode external")
    q.add_argument("--out", help="result JSON (default RUN_DIR/eval/step_N/manual.json)")


if __name__ == "__main__":
    sys.exit(main())
