"""train.optimizer_offload=nvme for the Megatron backend: megatron-core's CPU hybrid optimizer with its
state streamed through node-local NVMe.

megatron-core's HybridDeviceOptimizer (the `cpu` offload) keeps, per parameter shard of the
distributed optimizer, an fp32 master copy on the host and a torch CPU AdamW holding the two Adam
moments. Built with `overlap_cpu_optimizer_d2h_h2d`, it has one CPU AdamW per shard. This module
keeps that optimizer and its maths and moves its three fp32 tensors per shard (master, exp_avg,
exp_avg_sq) into files under train.offload_dir, one bucket per shard, through Miles' versioned
DiskStore (miles/train/offload/store.py: crash-safe versions, a reader thread ahead of the update
and a writer thread behind it, O_DIRECT where the filesystem allows it).

What is resident when:
  * between steps: no master copy and no moment; each of those tensors keeps its identity (megatron-core
    and torch reference them from several maps) but holds zero elements. Only Adam's scalar `step`
    tensors stay in memory.
  * during a step: the shard being updated and at most a few shards read ahead or being written (the
    DiskStore's staging images, each the size of the largest shard). Per shard: read, its gradient
    copied to the host, torch's fused CPU AdamW on views of the staging image, the bf16 parameter
    copied back to the GPU, image written as the next version.
  * during a checkpoint save or load (`resident`): the whole state, as with `cpu` offload, because
    megatron-core's dist-checkpointing reads and fills `optimizer.state` tensors in place. After a
    load the state goes back to disk as a new version.
  * at construction: megatron-core builds every fp32 master copy in host memory; they are written out
    and freed before the backend returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from miles.train.megatron.memory import chained_optimizers
from miles.train.offload.checks import OffloadError
from miles.train.offload.device import Download
from miles.train.offload.fileio import read_image, write_image
from miles.train.offload.layout import Bucket, align_up, aligned_empty, plan_buckets
from miles.train.offload.optimizer import disk_store
from miles.train.offload.store import DiskStore

MOMENTS = ("exp_avg", "exp_avg_sq")
FIELDS = [("master", torch.float32), ("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)]
"""The fp32 tensors of one shard, in the order they sit in its file."""


def _shard_bucket(index: int, numel: int) -> Bucket:
    """One bucket holding exactly one shard (a torch AdamW steps whole tensors, so shards are not cut)."""
    per_element = sum(torch.empty((), dtype=d).element_size() for _, d in FIELDS)
    (bucket,) = plan_buckets([numel], align_up(numel, 1024) * per_element, FIELDS)
    return dataclasses.replace(bucket, index=index)


def _free(t: torch.Tensor) -> None:
    """Drop a tensor's elements but keep the object (it is referenced from several maps)."""
    t.data = torch.empty(0, dtype=t.dtype)


class StreamedHybridOptimizer(HybridDeviceOptimizer):
    """A HybridDeviceOptimizer whose CPU state lives in files between steps (see the module docstring).

    Made from a built HybridDeviceOptimizer by `stream_optimizer` (its class is swapped, so every
    isinstance check of megatron-core still holds)."""

    store: DiskStore
    buckets: list[Bucket]
    streaming: bool

    def _slots(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        """(CPU AdamW, its fp32 shard) in a fixed order; megatron-core rebuilds them on every load."""
        if self.gpu_optimizer is not None:
            raise OffloadError(
                "train.optimizer_offload=nvme streams the CPU optimizer's state and found part of it on "
                "the GPU: megatron-core must be built with optimizer_offload_fraction=1"
            )
        out = []
        for opt in self.cpu_optimizers:
            params = [p for g in opt.param_groups for p in g["params"]]
            if len(params) != 1:
                raise OffloadError(
                    "train.optimizer_offload=nvme needs one CPU optimizer per shard "
                    "(megatron-core's overlap_cpu_optimizer_d2h_h2d=True)"
                )
            out.append((opt, params[0]))
        return out

    def setup_stream(self, directory: str, name: str, require_local: bool) -> None:
        """Open the bucket files (one per shard) under <directory>/<name>/, write the initial master
        copies there and free them."""
        slots = self._slots()
        self.buckets = [
            _shard_bucket(i, self.cpu_copys_map_gpu_param[p].numel()) for i, (_, p) in enumerate(slots)
        ]
        self.store = disk_store(directory, name, self.buckets, require_local, torch.cuda.is_available())
        self.streaming = False
        self.spill()

    def state_bytes(self) -> int:
        """Bytes of streamed state (all shards' files of one version)."""
        return sum(b.nbytes for b in self.buckets)

    def _check_slots(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        slots = self._slots()
        numels = [self.cpu_copys_map_gpu_param[p].numel() for _, p in slots]
        if numels != [b.numel for b in self.buckets]:
            raise OffloadError(
                "the Megatron optimizer's shards changed since their NVMe files were laid out; "
                "train.optimizer_offload=nvme needs the same model and parallelism for the whole run"
            )
        return slots

    def _meta(self) -> dict:
        return {"format": 1, "layout": [b.signature() for b in self.buckets]}

    def spill(self) -> None:
        """Write every resident shard (master copy and moments) as a new version, then free it."""
        slots = self._check_slots()
        self._sync_sub_optimizers_state_to_hdo()  # `master_param` of each state: the shard itself
        self.store.begin()
        for bucket, (opt, p) in zip(self.buckets, slots, strict=True):
            image = aligned_empty(bucket.nbytes)
            views = bucket.views(image)
            views["master"].copy_(p.detach().reshape(-1))
            state = opt.state.get(p, {})
            for k in MOMENTS:
                if k in state:
                    views[k].copy_(state[k].reshape(-1))
                else:
                    views[k].zero_()
            write_image(self.store.file(bucket.index, self.store.version + 1), image, self.store.direct)
            self._release(opt, p)
        self.store.commit(self._meta())
        self.cpu_copy_map_grad.clear()
        self.streaming = True

    def fill(self) -> None:
        """Read every shard's committed version back into its tensors (the whole state resident)."""
        for bucket, (opt, p) in zip(self.buckets, self._check_slots(), strict=True):
            image = aligned_empty(bucket.nbytes)
            read_image(self.store.file(bucket.index), image, self.store.direct)
            self._attach(bucket, image, opt, p)
        self.streaming = False

    def _attach(self, bucket: Bucket, image: torch.Tensor, opt: Any, p: torch.Tensor) -> None:
        """Point a shard and its moments (if Adam has state yet) at the views of a host image."""
        views = bucket.views(image)
        shape = self.cpu_copys_map_gpu_param[p].shape
        p.data = views["master"].view(shape)
        state = opt.state.get(p, {})
        for k in MOMENTS:
            if k in state:
                state[k].data = views[k].view(shape)

    @staticmethod
    def _release(opt: Any, p: torch.Tensor) -> None:
        p.grad = None
        _free(p)
        for k in MOMENTS:
            if k in opt.state.get(p, {}):
                _free(opt.state[p][k])

    def step(self, closure: Any = None) -> Any:
        """Resident: megatron-core's step. Streaming: shard by shard through the DiskStore pipeline."""
        if not self.streaming:
            return super().step(closure)
        self._sync_hdo_param_groups_to_sub_optimizers()
        slots = self._check_slots()
        self.store.begin()
        try:
            for bucket, (opt, p) in zip(self.buckets, slots, strict=True):
                self._step_shard(bucket, opt, p)
            self.store.commit(self._meta())
        except BaseException:
            self.store.abort()
            raise
        self._sync_sub_optimizers_state_to_hdo()
        return None

    def _step_shard(self, bucket: Bucket, opt: Any, p: torch.Tensor) -> None:
        image = self.store.acquire(bucket.index)
        self._attach(bucket, image, opt, p)
        fresh = not opt.state.get(p)
        gpu_param = self.cpu_copys_map_gpu_param[p]
        grad = getattr(gpu_param, "decoupled_grad", gpu_param.grad)  # as megatron-core's own step reads it
        p.grad = None if grad is None else grad.to("cpu", torch.float32)
        opt.step()  # torch's AdamW; megatron-core's post-step hook copies the shard back to the GPU
        if fresh and opt.state.get(p):  # Adam made its moments this step: move them into the image
            views = bucket.views(image)
            for k in MOMENTS:
                views[k].copy_(opt.state[p][k].reshape(-1))
        landed = Download(self._h2d_stream.record_event())  # the copy back reads the image
        self._release(opt, p)
        self.store.release(bucket.index, image, landed)

    def close(self) -> None:
        """Stop the I/O threads (the files stay as last committed)."""
        self.store.close()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return [o.optimizer for o in chained_optimizers(optimizer) if getattr(o, "optimizer", None) is not None]


def stream_optimizer(optimizer: Any, offload_dir: str | None, require_local: bool, rank: int) -> None:
    """Turn each HybridDeviceOptimizer inside a megatron-core optimizer into a StreamedHybridOptimizer
    whose files are <offload_dir>/megatron_rank<R>_opt<I>/."""
    if not offload_dir:
        raise OffloadError(
            "train.optimizer_offload=nvme needs train.offload_dir (a directory on node-local NVMe)"
        )
    for i, inner in enumerate(_inner_optimizers(optimizer)):
        if not isinstance(inner, HybridDeviceOptimizer):
            raise OffloadError(
                f"train.optimizer_offload=nvme expected megatron-core's HybridDeviceOptimizer, got {type(inner)}"
            )
        inner.__class__ = StreamedHybridOptimizer
        inner.setup_stream(offload_dir, f"megatron_rank{rank:05d}_opt{i}", require_local)


@contextlib.contextmanager
def resident(optimizer: Any, write_back: bool) -> Iterator[None]:
    """The whole streamed state in host memory for a checkpoint save (write_back=False: only freed
    afterwards) or load (write_back=True: written as a new version afterwards). No-op for other
    optimizers."""
    streamed = [o for o in _inner_optimizers(optimizer) if isinstance(o, StreamedHybridOptimizer)]
    for o in streamed:
        o.fill()
    try:
        yield
    finally:
        for o in streamed:
            if write_back:
                o.spill()
            else:
                o._sync_sub_optimizers_state_to_hdo()
                for opt, p in o._check_slots():
                    o._release(opt, p)
                o.cpu_copy_map_grad.clear()
                o.streaming = True
