"""AdamW whose state (moments, and fp32 master weights for low-precision parameters) lives off the device.

`OffloadedAdamW` is a torch.optim.Optimizer (so LR schedulers and `zero_grad` work unchanged) whose
`step()` walks the buckets of layout.py through a three-stage pipeline: fetch bucket n+1 (disk
read and/or host->device copy), update bucket n on the parameters' device, return bucket n-1
(device->host copy and/or disk write). The update itself is adamw.py, exactly torch's AdamW.

Parameters may be plain tensors or DTensors (FSDP2): each rank updates its local shard only, and
a rank's state is a function of its shard. Per-parameter step counts are kept like torch's (a
parameter whose grad is None is skipped and its count does not advance). A step that fails
half-way leaves parameters partly updated, so the optimiser refuses further steps until state is
reloaded from a checkpoint with `load_state`; on disk, the last committed version stays intact.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import torch

from miles.train.offload import checkpoint
from miles.train.offload.adamw import Hyper, adamw_stored_
from miles.train.offload.checks import OffloadError, check_free_space, check_offload_dir
from miles.train.offload.device import make_stage
from miles.train.offload.fileio import probe_direct_io
from miles.train.offload.layout import Bucket, plan_buckets
from miles.train.offload.store import DiskStore, MemoryStore

log = logging.getLogger("miles.train.offload")

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Storage dtypes of the Adam moments, by config name."""

STAGING_BUFFERS = 4
"""Reusable staging images of the NVMe pipeline: two reads ahead, one updating, one being written."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def disk_store(
    directory: str | None, name: str, buckets: list[Bucket], require_local: bool, pin: bool
) -> DiskStore:
    """The DiskStore of `buckets` in <directory>/<name>/ (one sub-directory per rank, so ranks sharing
    a node never share files), after checking train.offload_dir (set, local storage when
    `require_local`, room for two versions of the state); files a crashed run left there are removed."""
    if not directory:
        raise OffloadError(
            "train.optimizer_offload=nvme needs train.offload_dir (a directory on node-local NVMe)"
        )
    check_offload_dir(directory, require_local)
    root = Path(directory) / name
    root.mkdir(exist_ok=True)
    store = DiskStore(root, buckets, probe_direct_io(root), STAGING_BUFFERS, pin)
    store.remove_stale()
    check_free_space(root, 2 * sum(b.nbytes for b in buckets))
    log.info(
        "streaming %.1f MiB of optimiser state in %d buckets through %s (%s I/O)",
        sum(b.nbytes for b in buckets) / 2**20,
        len(buckets),
        root,
        "O_DIRECT" if store.direct else "buffered",
    )
    return store


class OffloadedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW semantics with state streamed bucket by bucket from host memory or NVMe."""

    def __init__(
        self,
        params: Any,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        mode: Literal["cpu", "nvme"] = "cpu",
        bucket_bytes: int = 256 * 2**20,
        moment_dtype: torch.dtype = torch.float32,
        directory: str | None = None,
        rank: int = 0,
        require_local: bool = True,
    ) -> None:
        self._ready = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.rank, self.mode = rank, mode
        self.flat_params = [p for g in self.param_groups for p in g["params"]]
        self.group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        shards = [local_tensor(p.detach()) for p in self.flat_params]
        self.device = shards[0].device
        for i, t in enumerate(shards):
            if t.device != self.device or not t.is_contiguous():
                raise ValueError(f"parameter {i}: offload needs contiguous parameters on one device")
        self.keep_master = any(t.dtype != torch.float32 for t in shards)
        fields = [("exp_avg", moment_dtype), ("exp_avg_sq", moment_dtype)]
        fields += [("master", torch.float32)] if self.keep_master else []
        self.buckets = plan_buckets([t.numel() for t in shards], bucket_bytes, fields)
        self.bucket_bytes, self.moment_dtype = bucket_bytes, moment_dtype
        self.steps = [0] * len(self.flat_params)
        self.failed: str | None = None
        pin = self.device.type == "cuda"
        if mode == "cpu":
            self.store: MemoryStore | DiskStore = MemoryStore(self.buckets, pin)
        elif mode == "nvme":
            self.store = disk_store(directory, f"rank_{rank:05d}", self.buckets, require_local, pin)
        else:
            raise OffloadError(f"train.optimizer_offload={mode!r} is not one of: cpu, nvme")
        # a rank may hold no elements at all (FSDP2 shards of tiny models): zero buckets is valid
        self.stage = make_stage(self.device, max((b.nbytes for b in self.buckets), default=0))
        self.scratch = torch.empty(
            max((b.numel for b in self.buckets), default=0), dtype=torch.float32, device=self.device
        )
        self._ready = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._ready:
            raise ValueError("OffloadedAdamW fixes its bucket layout at construction; pass all groups then")
        super().add_param_group(param_group)

    def state_bytes(self) -> int:
        """Bytes of optimiser state (all buckets)."""
        return sum(b.nbytes for b in self.buckets)

    def _hypers(self) -> list[Hyper]:
        return [
            Hyper(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), g["eps"], g["weight_decay"])
            for g in self.param_groups
        ]

    def meta(self, steps: list[int]) -> dict:
        """What a manifest records besides files: format, step counts and the layout it fits."""
        return {
            "format": 1,
            "steps": steps,
            "bucket_bytes": self.bucket_bytes,
            "moment_dtype": str(self.moment_dtype).removeprefix("torch."),
            "layout": [b.signature() for b in self.buckets],
        }

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.failed:
            raise RuntimeError(f"{self.failed}; reload the optimiser state with load_state(checkpoint_dir)")
        shards = [local_tensor(p) for p in self.flat_params]
        grads = [None if p.grad is None else local_tensor(p.grad) for p in self.flat_params]
        steps = [s + (g is not None) for s, g in zip(self.steps, grads, strict=True)]
        self.store.begin()
        try:
            self._pipeline(shards, grads, self._hypers())
            self.store.commit(self.meta(steps))
        except BaseException as e:
            self.failed = f"an optimiser step failed half-way ({type(e).__name__}: {e})"
            self.store.abort()
            raise
        self.steps = steps
        return loss

    def _pipeline(self, shards: list[torch.Tensor], grads: list, hypers: list[Hyper]) -> None:
        """Fetch n+1 / update n / return n-1, over all buckets."""
        if not self.buckets:
            return
        host = self.store.acquire(0)
        up = self.stage.upload(host)
        for i, bucket in enumerate(self.buckets):
            cur, cur_host = up, host
            if i + 1 < len(self.buckets):
                host = self.store.acquire(i + 1)
                up = self.stage.upload(host)
            cur.ready()
            self._update(bucket, bucket.views(cur.image), shards, grads, hypers)
            self.store.release(i, cur_host, self.stage.download(cur, cur_host))

    def _update(self, bucket: Bucket, views: dict, shards: list, grads: list, hypers: list[Hyper]) -> None:
        for piece in bucket.pieces:
            grad = grads[piece.param]
            if grad is None:
                continue
            src = slice(piece.start, piece.start + piece.numel)
            dst = slice(piece.offset, piece.offset + piece.numel)
            param = shards[piece.param].view(-1)[src]
            m, v = views["exp_avg"][dst], views["exp_avg_sq"][dst]
            master = views["master"][dst] if self.keep_master else param
            step = self.steps[piece.param] + 1
            if step == 1:
                m.zero_()
                v.zero_()
                if self.keep_master:
                    master.copy_(param)
            g = grad.reshape(-1)[src]
            adamw_stored_(master, g, m, v, step, hypers[self.group_of[piece.param]], self.scratch)
            if self.keep_master:
                param.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters and step counts only; the streamed state is saved by `save_state`."""
        out = super().state_dict()
        out["offload"] = {"mode": self.mode, "steps": list(self.steps)}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        state_dict.pop("offload", None)
        super().load_state_dict(state_dict)

    def save_state(self, directory: str | Path) -> Path:
        """Persist the streamed state under directory (hard links for nvme); returns the state dir."""
        return checkpoint.save_state(self, Path(directory))

    def load_state(self, directory: str | Path) -> None:
        """Restore state written by `save_state`; refuses an incomplete or mismatched one."""
        checkpoint.load_state(self, Path(directory))
        self.failed = None

    def close(self) -> None:
        """Stop the I/O threads (the state on disk stays as committed)."""
        self.store.close()


def build_optimizer(params: Any, cfg: Any, rank: int) -> OffloadedAdamW:
    """The offloaded AdamW for `train.optimizer_offload` in {cpu, nvme}, from a TrainConfig."""
    if cfg.optimizer_offload not in ("cpu", "nvme"):
        raise OffloadError(
            f"build_optimizer handles train.optimizer_offload=cpu|nvme, not {cfg.optimizer_offload!r}"
        )
    if cfg.offload_bucket_mb < 1:
        raise OffloadError(f"train.offload_bucket_mb must be >= 1 (got {cfg.offload_bucket_mb})")
    return OffloadedAdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        mode=cfg.optimizer_offload,
        bucket_bytes=cfg.offload_bucket_mb * 2**20,
        moment_dtype=MOMENT_DTYPES[cfg.offload_moment_dtype],
        directory=cfg.offload_dir,
        rank=rank,
        require_local=cfg.offload_require_local,
    )
