"""A small job-side program that exercises the Slurm mechanics the way the RL loop uses them.

`python -m miles.cluster.selftest --run-dir DIR [--resume]` (run as `launch.actor_module`): every
trainer rank checks /health of every published engine, joins the gloo process group from the
bootstrap's variables and all-reduces its rank; then it runs `train.steps` steps of `--step-s`
seconds, honouring the loop's contract: RUN_DIR/control/preempt at a step boundary -> write a
complete checkpoint (checkpoints/step_N/.complete) and exit 0; --resume -> continue after the latest
complete checkpoint. Rank 0 appends one metrics line per step and writes selftest.json at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from miles.cluster.bootstrap import incarnation
from miles.cluster.distributed import init_distributed, teardown_distributed
from miles.cluster.environment import JobEnvironment
from miles.cluster.rendezvous import healthy, read_engines
from miles.config import read_plan


def latest_checkpoint(run_dir: Path) -> int:
    """Step of the newest checkpoint whose .complete marker exists (0 if none)."""
    steps = [int(p.parent.name.split("_")[1]) for p in run_dir.glob("checkpoints/step_*/.complete")]
    return max(steps, default=0)


def _checkpoint(run_dir: Path, step: int) -> None:
    d = run_dir / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "state.json").write_text(json.dumps({"step": step}))
    (d / ".complete").touch()  # written last


def _agree(flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.cluster.selftest", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--step-s", type=float, default=0.5)
    args = p.parse_args(argv)
    run_dir: Path = args.run_dir
    plan = read_plan(run_dir / "plan.yaml")
    env = init_distributed("cpu", timeout_s=plan.train.collective_timeout_s)
    urls = [r["url"] for r in read_engines(run_dir, incarnation(env))]
    assert urls and all(healthy(u) for u in urls), f"engines not healthy: {urls}"
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    start = latest_checkpoint(run_dir) if args.resume else 0
    preempted, done = False, start
    for step in range(start, plan.train.steps):
        if _agree((run_dir / "control" / "preempt").exists()):
            preempted = True
            break
        time.sleep(args.step_s)
        dist.all_reduce(torch.ones(1))
        if env.rank == 0:
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": step + 1, "selftest/world": env.world_size}) + "\n")
        done = step + 1
    if env.rank == 0:
        _checkpoint(run_dir, done)
        result = {
            "world_size": env.world_size,
            "allreduce": t.item(),
            "engines": urls,
            "start_step": start,
            "end_step": done,
            "preempted": preempted,
            "restart_count": JobEnvironment.from_env().restart_count,
        }
        (run_dir / "selftest.json").write_text(json.dumps(result))
    teardown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
