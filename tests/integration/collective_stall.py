"""Actor program of the hung-collective tests: one rank stops taking part in a collective.

    python -m tests.integration.collective_stall --run-dir RUN_DIR [--resume] [--device cuda]

Every rank joins the trainer's process group exactly as the trainer does (miles.cluster.distributed,
timeout = the plan's `train.collective_timeout_s`) and all-reduces once; then the last rank stops
participating (it sleeps) while the others enter the next all-reduce, which must time out and fail
their rank. The launcher (torchrun, or srun with --kill-on-bad-exit) then ends the stalled rank.
On CUDA (NCCL) the collective is asynchronous: the waiting rank blocks in the synchronisation, and
PyTorch's watchdog times the collective out, writes the flight recorder and aborts the rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from miles.cluster.distributed import init_distributed
from miles.config import read_plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--resume", action="store_true", help="accepted like the loop's; unused")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo, cuda: NCCL")
    args = p.parse_args(argv)
    plan = read_plan(args.run_dir / "plan.yaml")
    env = init_distributed(args.device, timeout_s=plan.train.collective_timeout_s)
    device = torch.device(args.device, env.local_rank) if args.device == "cuda" else torch.device("cpu")
    dist.all_reduce(torch.ones(1, device=device))
    print(f"rank {env.rank}/{env.world_size}: joined, timeout {plan.train.collective_timeout_s}s", flush=True)
    if env.rank == env.world_size - 1:
        print(f"rank {env.rank}: stops participating", flush=True)
        time.sleep(3600)
    dist.all_reduce(torch.ones(1, device=device))  # never completes: the last rank is not there
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"rank {env.rank}: the collective completed without the stalled rank", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
