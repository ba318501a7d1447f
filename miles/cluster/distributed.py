"""Start and stop the default torch.distributed process group of the trainer ranks.

Who the ranks are comes from `JobEnvironment.from_env()` (torchrun, srun or mpirun set the variables);
this module only turns that into a process group: gloo for CPU tensors, NCCL for CUDA tensors, with
one timeout for every collective. A single process without a launcher still gets a real (world size
1) process group over an in-memory store, so FSDP and torch.distributed.checkpoint run unchanged and
no port is opened.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from miles.cluster.environment import JobEnvironment

log = logging.getLogger("miles.cluster")


def init_distributed(
    device: str = "cpu", timeout_s: float = 600.0, env: JobEnvironment | None = None
) -> JobEnvironment:
    """Initialise the default process group for `device` ("cpu" -> gloo, "cuda" -> NCCL); idempotent.

    Multi-rank jobs rendezvous at MASTER_ADDR:MASTER_PORT, which the launcher must export (torchrun
    does; under srun the Miles launcher writes them). Returns the environment that was used.
    """
    env = env or JobEnvironment.from_env()
    if dist.is_initialized():
        return env
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    device_id = None
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
        device_id = torch.device("cuda", env.local_rank)
    if env.world_size == 1 and not (env.master_addr and env.master_port):
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
        return env
    if not (env.master_addr and env.master_port):
        raise RuntimeError(
            f"{env.world_size} ranks ({env.source}) but MASTER_ADDR/MASTER_PORT are not set: start the "
            "trainer with torchrun, or through `miles train` / `miles submit`, which export them"
        )
    log.info(
        "process group: %s rank %d/%d via %s:%d",
        backend,
        env.rank,
        env.world_size,
        env.master_addr,
        env.master_port,
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device_id,
    )
    return env


def teardown_distributed() -> None:
    """Destroy the default process group if one exists (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()
