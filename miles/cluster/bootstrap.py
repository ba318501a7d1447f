"""Job-side entry of every role: `python -m miles.cluster.bootstrap {rollout,eval,actor} --run-dir DIR`.

rollout (one task per rollout node): start this node's engines (embedded `miles.engine`, or SGLang
servers rendered by miles.rollout.sglang), publish each URL once it answers /health, put the
sglang-router in front on the group's first node when there is more than one engine, then wait;
SIGTERM stops exactly the children it started.

eval (one task per node of the eval group, `eval.mode: dedicated`): the same for the eval engines,
without a router, published in RUN_DIR/rendezvous/eval_engines/ (the trainer's eval runner reads
them there and loads each snapshot into them). An engine that exits ends the step with 1; the batch
script lets the job go on without it.

actor (one task per trainer rank): wait until all engines of this incarnation are healthy, derive
MASTER_ADDR (first node of the actor group) and MASTER_PORT (from the job id), find rank and world
size (Slurm variables, or mpi4py under `srun --mpi=pmix` when the profile says so), export them in
torchrun's names, and exec the command after `--` (the loop, always with --resume).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miles.cluster.environment import JobEnvironment, intra_op_threads
from miles.cluster.network import interface_variables
from miles.cluster.rendezvous import (
    ENGINES,
    EVAL_ENGINES,
    healthy,
    master_port,
    node_address,
    publish_engine,
    wait_for_engines,
)
from miles.config import Plan, read_plan
from miles.processes import child_options, stop_processes
from miles.rollout.engine_argv import engine_argv
from miles.serving import check_bind, key_arguments, run_keys, sglang_key_arguments


def _facts(run_dir: Path) -> tuple[Plan, dict[str, Any]]:
    return read_plan(run_dir / "plan.yaml"), json.loads((run_dir / "launch.json").read_text())


def incarnation(env: JobEnvironment) -> str:
    """`<job id>.<restart count>`: engines of an earlier start of a requeued job are ignored."""
    return env.incarnation


def share_cpus(env: JobEnvironment, processes: int) -> int:
    """Export OMP_NUM_THREADS for the `processes` torch processes this task runs, and log it.

    Without it every engine and trainer rank would start one thread per core it sees, and the
    processes of one node would oversubscribe its cores (the rule: miles.cluster.environment's
    intra_op_threads; each torch process then logs the threads it really runs with).
    """
    threads, origin = intra_op_threads(processes)
    how = "exported" if env.omp_num_threads else "derived"
    os.environ["OMP_NUM_THREADS"] = str(threads)
    print(
        f"miles bootstrap: threads: torch intra-op {threads} for each of {processes} process(es) "
        f"(from {origin}); {how} OMP_NUM_THREADS={threads}",
        file=sys.stderr,
        flush=True,
    )
    return threads


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A child that dies with this process, even on SIGKILL (its own session, parent-death signal)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **child_options())


class StartFailed(Exception):
    """An engine or server that did not come up: why, its process (stopped by the caller) and its log."""

    def __init__(self, why: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        super().__init__(why)
        self.proc, self.log = proc, log


def _wait_url(proc: subprocess.Popen[bytes], url_file: Path, deadline: float, log: Path) -> str:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartFailed(f"exited with {proc.returncode} before serving", proc, log)
        if url_file.exists():
            url = json.loads(url_file.read_text())["url"]
            if healthy(url):
                return url
        time.sleep(0.2)
    raise StartFailed("did not serve within engine.startup_timeout_s", proc, log)


def _start_engine(
    plan: Plan, facts: dict[str, Any], run_dir: Path, env: JobEnvironment, i: int, role: str = "rollout"
) -> tuple:
    """Engine i of this node for `role` (rollout or eval), published once healthy; (process, log)."""
    from miles.rollout.sglang import sglang_port, sglang_server_command

    node = env.node_name or "local"
    loopback = facts["engine_host"] == "loopback"
    bind, advertise = ("127.0.0.1", "127.0.0.1") if loopback else ("0.0.0.0", node_address(node))
    prefix = "eval-" if role == "eval" else ""
    log = run_dir / "logs" / f"{prefix}engine-{node}-{i}.log"
    deadline = time.monotonic() + plan.engine.startup_timeout_s
    # eval engines sample with seeds of their own (as `miles train` starts them), and take the SGLang
    # ports after the rollout engines' (a one-host cluster may put both groups on one machine)
    seed = plan.run.seed + (1000 + i if role == "eval" else 0)
    port_index = i + (facts["engines_per_node"] if role == "eval" else 0)
    if facts["engine_kind"] == "embedded":
        url_file = run_dir / "rendezvous" / "tmp" / f"{prefix}{node}-{i}.json"
        url_file.parent.mkdir(parents=True, exist_ok=True)
        url_file.unlink(missing_ok=True)
        e = plan.engine
        argv = [
            sys.executable,
            "-m",
            "miles.engine",
            "--model",
            plan.model.path,
            "--host",
            bind,
            "--port",
            "0",
        ]
        argv += ["--device", e.device, "--max-running-requests", str(e.max_running_requests)]
        argv += ["--max-total-tokens", str(e.max_total_tokens), "--seed", str(seed)]
        argv += engine_argv(plan) + key_arguments(run_dir)
        if plan.train.routing_replay == "rollout" and role == "rollout":  # R3: the rollout's routing
            argv.append("--enable-return-routed-experts")
        proc = _spawn([*argv, "--url-file", str(url_file)], log)
        port = _wait_url(proc, url_file, deadline, log).rsplit(":", 1)[1]
    else:
        port = str(sglang_port(int(env.job_id or 0), port_index))
        argv = sglang_server_command(plan, host=bind, port=int(port), python=sys.executable)
        argv += sglang_key_arguments(run_dir)
        proc = _spawn(argv, log)
        while not healthy(f"http://{advertise}:{port}"):
            if proc.poll() is not None:
                raise StartFailed(f"exited with {proc.returncode} before serving", proc, log)
            if time.monotonic() > deadline:
                raise StartFailed("did not serve within engine.startup_timeout_s", proc, log)
            time.sleep(1.0)
    url = f"http://{advertise}:{port}"
    folder = EVAL_ENGINES if role == "eval" else ENGINES
    publish_engine(run_dir, f"{node}-{i}", url, proc.pid, node, incarnation(env), folder)
    return proc, log


def run_rollout(run_dir: Path, role: str = "rollout") -> int:
    """Start and watch this node's engines (and the router); a child that exits ends the step with 1,
    which the batch script turns into the end of the job (the trainer is not left waiting).
    `role="eval"`: the eval group's engines, no router; its step's end does not end the job."""
    env = JobEnvironment.from_env()
    plan, facts = _facts(run_dir)
    children: list[subprocess.Popen[bytes]] = []
    logs: dict[int, Path] = {}

    def stop(*_: object) -> None:
        stop_processes(children)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    per_node = facts["eval_engines_per_node"] if role == "eval" else facts["engines_per_node"]
    share_cpus(env, per_node)
    for i in range(per_node):
        try:
            proc, logs[i] = _start_engine(plan, facts, run_dir, env, i, role)
        except StartFailed as e:
            # one line naming the engine and its log (whose traceback `miles status` shows), no
            # traceback of this process to hide it
            node = env.node_name or "local"
            what = "eval engine" if role == "eval" else "engine"
            print(f"miles bootstrap: {what} {i} on {node} {e}; see {e.log}", file=sys.stderr, flush=True)
            stop_processes([*children, e.proc])
            return 1
        children.append(proc)
    if role == "rollout" and env.rank == 0 and facts["num_engines"] > 1:
        children.append(_start_router(plan, run_dir, env, facts))
        logs[len(children) - 1] = run_dir / "logs" / "router.log"
    while all(p.poll() is None for p in children):
        time.sleep(1.0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for i, p in enumerate(children):
        if p.returncode is not None:
            what = (
                "router" if logs[i].name == "router.log" else f"{'eval ' if role == 'eval' else ''}engine {i}"
            )
            print(
                f"miles bootstrap: {what} (pid {p.pid}) exited with {p.returncode}; see {logs[i]}",
                file=sys.stderr,
            )
    stop_processes(children)
    return 1


def _start_router(plan: Plan, run_dir: Path, env: JobEnvironment, facts: dict[str, Any]):
    from miles.rollout.sglang import router_command, router_port

    urls = wait_for_engines(run_dir, facts["num_engines"], plan.engine.startup_timeout_s, incarnation(env))
    host = "127.0.0.1" if facts["engine_host"] == "loopback" else node_address(env.node_name or "localhost")
    port = router_port(int(env.job_id or 0))
    bind = "127.0.0.1" if facts["engine_host"] == "loopback" else "0.0.0.0"
    keys = run_keys(run_dir)
    try:  # sglang-router has no such check of its own
        check_bind("sglang-router", bind, keys, allow_unauthenticated=False)
    except ValueError:
        raise SystemExit(
            f"miles bootstrap: the router would serve on {bind} without a key: {run_dir / 'keys'} is missing "
            "(submit the run with `miles submit`, which writes it)"
        ) from None
    argv = router_command(plan, host=bind, port=port, worker_urls=urls)
    argv += [f"--api-key={keys.api}"] if keys.api else []  # `=`: a key may start with "-"
    proc = _spawn(argv, run_dir / "logs" / "router.log")
    from miles.cluster.rendezvous import publish_router

    publish_router(run_dir, f"http://{host}:{port}", proc.pid, incarnation(env))
    return proc


def _mpi_ranks(first_node: str) -> tuple[int, int, int, str]:
    """(rank, world, local rank, master address) agreed over MPI (mpi4py under srun --mpi=pmix)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    addr = comm.bcast(node_address(first_node) if rank == 0 else None, root=0)
    MPI.Finalize()
    return rank, world, local, addr


def actor_variables(env: JobEnvironment, facts: dict[str, Any]) -> tuple[dict[str, str], str]:
    """torchrun-style variables of this trainer rank, and which mechanism supplied the ranks."""
    group = 1 if facts["layout"] == "disaggregated" else 0
    first = env.group_nodes(group)[0] if env.group_nodes(group) else (env.node_name or "localhost")
    if facts["bootstrap"] == "mpi":
        rank, world, local, addr = _mpi_ranks(first)
        source = "mpi"
    else:
        rank, world, local, addr = env.rank, env.world_size, env.local_rank, node_address(first)
        source = env.source
    port = master_port(env.job_id or 0)
    names = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local, "MASTER_ADDR": addr, "MASTER_PORT": port}
    # gloo and TensorPipe take interface names, not NCCL's `^` syntax: the one towards the master
    return {k: str(v) for k, v in names.items()} | interface_variables(addr, env.socket_ifname), source


def run_actor(run_dir: Path, command: list[str]) -> int:
    env = JobEnvironment.from_env()
    plan, facts = _facts(run_dir)
    wait_for_engines(run_dir, facts["num_engines"], plan.engine.startup_timeout_s, incarnation(env))
    variables, source = actor_variables(env, facts)
    from miles.cluster.rendezvous import write_atomic

    record = {**variables, "source": source, "node": env.node_name, "incarnation": incarnation(env)}
    write_atomic(run_dir / "rendezvous" / "ranks" / f"rank-{variables['RANK']}.json", record)
    os.environ.update(variables)
    share_cpus(env, 1)
    os.execvp(command[0], command)
    return 127  # not reached: exec replaces this process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.cluster.bootstrap", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["rollout", "eval", "actor"])
    p.add_argument("--run-dir", required=True, type=Path)
    p.epilog = "actor: append -- COMMAND... (exec'd once every engine is healthy)"
    argv = sys.argv[1:] if argv is None else argv
    # everything after `--` is the actor's command, passed through untouched
    cut = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.role in ("rollout", "eval"):
        return run_rollout(args.run_dir, args.role)
    if not command:
        p.error("actor needs the command to run after --")
    return run_actor(args.run_dir, command)


if __name__ == "__main__":
    sys.exit(main())
