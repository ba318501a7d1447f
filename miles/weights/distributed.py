"""DistributedTransport: broadcast each bucket from trainer rank 0 to all engines over a process group.

setup(): the trainer (rank 0) and every engine (rank 1 + i) join one update group
(/init_weights_update_group, gloo on CPU, NCCL on GPU). push(): per bucket, POST
/update_weights_from_distributed (names, dtypes, shapes) to all engines concurrently while rank 0
broadcasts the bucket's tensors in the same order; the engines receive them while they keep
generating and load them between two steps. The last bucket carries the new weight version.
Float8 tensors (an FP8 engine's weights) are announced with their own dtype (`float8_e4m3fn`);
`broadcast_from_trainer` moves their bytes as uint8 on both sides (gloo has no float8 type).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from miles.processes import free_port
from miles.weights.group import broadcast_from_trainer, destroy_update_group, init_update_group
from miles.weights.transport import (
    Bucket,
    EngineAdmin,
    Site,
    check_pause_mode,
    dtype_name,
    pause_mode_of,
    push_paused,
)

log = logging.getLogger(__name__)


class DistributedTransport:
    """torch.distributed broadcast into every engine (SGLang's update-from-distributed protocol)."""

    checks_in_push = False

    def __init__(
        self,
        engines: Sequence[EngineAdmin],
        master_address: str,
        master_port: int,
        *,
        backend: str = "gloo",
        group_name: str = "weight_update_group",
        pause_mode: str | None = "in_place",
        timeout_s: float = 300.0,
    ):
        check_pause_mode(pause_mode)
        self.engines = list(engines)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.group = None

    @classmethod
    def from_plan(cls, plan: Any, site: Site) -> DistributedTransport:
        """An update group at the trainer's address on a free port: NCCL when the trainer is on CUDA."""
        import torch

        device = plan.train.device
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        return cls(
            site.engines,
            site.address,
            free_port(site.address),
            backend="nccl" if cuda else "gloo",
            pause_mode=pause_mode_of(plan),
        )

    async def setup(self) -> None:
        world = 1 + len(self.engines)
        joins = [
            e.init_weights_update_group(
                self.master_address, self.master_port, 1 + i, world, self.group_name, self.backend
            )
            for i, e in enumerate(self.engines)
        ]
        mine = asyncio.to_thread(
            init_update_group,
            self.master_address,
            self.master_port,
            0,
            world,
            self.group_name,
            self.backend,
            self.timeout_s,
        )
        results = await asyncio.gather(mine, *joins)
        self.group = results[0]

    def _broadcast(self, bucket: Bucket) -> None:
        for _, tensor in bucket:
            t = tensor.detach()
            if self.backend == "nccl" and t.device.type != "cuda":
                t = t.cuda()
            broadcast_from_trainer(t.contiguous(), self.group)

    async def _send(self, bucket: Bucket, version: str | None) -> None:
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        posts = [
            e.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self.group_name, weight_version=version
            )
            for e in self.engines
        ]
        await asyncio.gather(asyncio.to_thread(self._broadcast, bucket), *posts)

    async def push(self, buckets: Iterable[Bucket], version: str) -> None:
        if self.group is None:
            raise RuntimeError(
                "DistributedTransport.push before setup(): call `await transport.setup()` first"
            )
        await push_paused(self.engines, self.pause_mode, buckets, version, self._send)

    async def close(self) -> None:
        """Leave the group on both sides; engines that cannot be reached are skipped (after an engine
        was lost, the survivors must drop the old group before a new one of the same name forms)."""
        if self.group is None:
            return
        leaving = [e.destroy_weights_update_group(self.group_name) for e in self.engines]
        for engine, result in zip(
            self.engines, await asyncio.gather(*leaving, return_exceptions=True), strict=True
        ):
            if isinstance(result, Exception):
                log.info(
                    "engine %s did not leave the update group: %s", getattr(engine, "url", engine), result
                )
        destroy_update_group(self.group)
        self.group = None
