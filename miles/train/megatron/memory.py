"""Free the GPU memory of the training state between steps, and bring it back unchanged.

Every tensor of the model, its DDP gradient/parameter buffers and the optimiser is a view of some
storage. Copying each distinct storage to pinned host memory and then resizing it to zero bytes
frees the device memory while every view (and Megatron's internal pointers to them) stays valid;
onload resizes the storage back and copies the bytes in. This is the same trick FSDP uses to free
unsharded parameters, applied to the whole training state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def chained_optimizers(optimizer: Any) -> list[Any]:
    """The megatron-core optimizers inside `optimizer`: those of a ChainedOptimizer (e.g. one for the
    dense and one for the expert parameters), else `optimizer` alone."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class StorageOffloader:
    """Offload / onload a fixed set of CUDA tensors by their storages (deduplicated)."""

    storages: list[torch.UntypedStorage]
    host: list[torch.Tensor | None]

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                st = t.untyped_storage()
                if st.nbytes() > 0:
                    seen.setdefault(st.data_ptr(), st)
        self.storages = list(seen.values())
        self.host = [None] * len(self.storages)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host if h is not None) or sum(s.nbytes() for s in self.storages)

    def offload(self) -> None:
        for i, st in enumerate(self.storages):
            if st.nbytes() == 0:
                continue
            host = self.host[i]
            if host is None or host.numel() != st.nbytes():
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=True)
            host.copy_(torch.tensor([], dtype=torch.uint8, device=st.device).set_(st), non_blocking=True)
            self.host[i] = host
        torch.cuda.synchronize()
        for st in self.storages:
            st.resize_(0)
        torch.cuda.empty_cache()

    def onload(self) -> None:
        for st, host in zip(self.storages, self.host, strict=True):
            if host is None or st.nbytes() != 0:
                continue
            st.resize_(host.numel())
            torch.tensor([], dtype=torch.uint8, device=st.device).set_(st).copy_(host, non_blocking=True)
        torch.cuda.synchronize()


def training_tensors(backend: Any) -> list[torch.Tensor]:
    """Parameters, main grads, DDP buffers and optimiser state/master weights of a MegatronBackend and
    of its PPO critic, and its reference model's parameters (state the CPU-offloading optimiser keeps on
    the host is skipped by StorageOffloader, which takes CUDA tensors only)."""
    out: list[torch.Tensor] = []
    if getattr(backend, "ref_model", None) is not None:
        out += [p.data for p in backend.ref_model.parameters()]
    if getattr(backend, "critic", None) is not None:
        out += _model_tensors(backend.critic)
    return out + _model_tensors(backend)


def _model_tensors(owner: Any) -> list[torch.Tensor]:
    """Parameters, main grads, DDP buffers and optimiser state of `owner`'s model and optimizer."""
    out: list[torch.Tensor] = []
    for p in owner.model.parameters():
        out.append(p.data)
        if getattr(p, "main_grad", None) is not None:
            out.append(p.main_grad)
    for name in ("buffers", "expert_parallel_buffers"):
        bufs = getattr(owner.model, name, None)
        for buf in bufs if isinstance(bufs, list) else []:
            for attr in ("param_data", "grad_data"):
                if getattr(buf, attr, None) is not None:
                    out.append(getattr(buf, attr))
    for opt in chained_optimizers(owner.optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            out += [p.data for p in group["params"]]
        for state in inner.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out
