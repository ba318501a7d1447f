"""The weight-update process group shared by a trainer rank and the engines.

Built the way SGLang's `init_custom_process_group` and upstream trainers build it, so a trainer can
talk to real SGLang servers and to the embedded engine alike, in either role: a TCPStore at
master_address:master_port hosted by rank 0 (the trainer), every rank counted in as torch's `tcp://`
rendezvous counts it (the host of a `tcp://` store waits until all world_size ranks have checked in,
so a rank that connects without checking in leaves the host waiting until its timeout), a store
prefixed with the group name, and a fresh process group beside, not instead of, the default one.
Engine i of n (one rank each) is rank rank_offset + i. Backend `gloo` on CPU, `nccl` on GPU.

Every wait is bounded by `timeout_s`: connecting to the store, the host waiting for all ranks, the
backend's own rendezvous, and each collective of the group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKENDS = ("gloo", "nccl")


def init_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the update group; blocks until all world_size ranks have joined, at most
    about `timeout_s` per stage (store, then backend), and raises when they have not."""
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r} for the weight-update group; known: {', '.join(BACKENDS)}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the update group of size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    # A TCPStore made here, not `dist.rendezvous("tcp://...")`: under torchrun that handler turns every
    # rank into a client of the elastic agent's store, and the trainer (rank 0) must host this one.
    # wait_for_workers=True is what `tcp://` does: each rank checks in, the host waits for all of them.
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=True,
        multi_tenant=rank == 0,
    )
    store = dist.PrefixStore(group_name, store)
    default = c10d._world.default_pg if dist.is_initialized() else None
    bound = default.bound_device_id if default is not None else None
    if bound is not None:
        # A trainer's default group bound to its GPU (eager NCCL init) makes torch build every new NCCL
        # group by splitting the default group's communicator, which the engines are not part of: the
        # first broadcast would wait forever. This group is created unbound, from the store alone.
        default.bound_device_id = None
    try:
        pg, _ = c10d._new_process_group_helper(
            world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
        )
    finally:
        if bound is not None:
            default.bound_device_id = bound
    # Ranks of this group are its own ranks (it is not a sub-group of the default world).
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_from_trainer(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Broadcast in place from group rank 0 (the trainer) to every engine rank. One-byte floats
    (float8, an FP8 engine's weights) travel as a uint8 view of their bytes: gloo has no float8."""
    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
        tensor = tensor.view(torch.uint8)
    dist.broadcast(tensor, group=group, group_src=0)


def destroy_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
