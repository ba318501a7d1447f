"""TensorTransport: hand the trainer's tensors to engines on the same host by reference, not by copy.

For colocated runs (engine and trainer on one GPU) and any engine on the trainer's host. Each bucket
is packed into one flat buffer per dtype; the engine receives, in SGLang's
/update_weights_from_tensor body, a list of (name, view of that buffer) pickled with
torch.multiprocessing's reductions and base64-encoded (SGLang's MultiprocessingSerializer format).
For CUDA tensors the pickle carries a CUDA IPC handle of the buffer, so the engine maps the
trainer's memory and copies from it on the device (one handle per buffer, not per tensor); CPU
tensors travel through shared memory files (the `file_system` sharing strategy, which needs no
connection between the two processes). The buffer is kept alive until every engine has answered.

NCCL cannot broadcast between two processes on one GPU, which is why colocated runs use this
transport instead of the distributed one.

A body is decoded by `TensorUnpickler`, never by the standard unpickler: it resolves only the
globals a tensor payload names (torch's tensor and storage rebuilds, dtypes, `torch.Size`,
`OrderedDict`), so a pickle that names anything else (`os.system`, `builtins.eval`, ...) is refused
before it runs, as SGLang's SafeUnpickler refuses it. The inline format's storages are nested
`torch.save` bytes, which torch opens with `weights_only=False`; here they go through
`torch.load(weights_only=True)` instead.
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.multiprocessing import reductions  # noqa: F401  (registers the tensor reductions)

from miles.weights.transport import Bucket, Site, check_pause_mode, pause_mode_of, push_paused


def pack(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views into one new flat buffer per (device, dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, t in bucket:
        groups.setdefault((t.device, t.dtype), []).append((name, t.detach()))
    out = []
    for (device, dtype), items in groups.items():
        flat = torch.empty(sum(t.numel() for _, t in items), dtype=dtype, device=device)
        offset = 0
        for name, t in items:
            view = flat[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            out.append((name, view))
            offset += t.numel()
    return out


def serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's MultiprocessingSerializer: ForkingPickler + base64 text."""
    if any(t.device.type == "cpu" for _, t in named):
        torch.multiprocessing.set_sharing_strategy("file_system")
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_inline(named: list[tuple[str, torch.Tensor]]) -> str:
    """The same payload with the tensors' bytes inside (a plain pickle of host copies): for small
    tensors (LoRA adapters) sent to an engine on any host, not only this one."""
    return base64.b64encode(pickle.dumps([(n, t.detach().cpu().contiguous()) for n, t in named])).decode(
        "ascii"
    )


def _load_storage_bytes(b: bytes) -> Any:
    """torch.storage._load_from_bytes without code execution: the nested bytes are torch.save output."""
    return torch.load(io.BytesIO(b), weights_only=True)


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,  # a CUDA tensor's storage class
    ("torch", "TypedStorage"): torch.TypedStorage,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    **{
        (_REDUCTIONS, name): getattr(reductions, name)
        for name in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
        )
    },
}
"""What a tensor payload may name, by (module, name); dtypes (`torch.float32`, ...) are admitted too."""


class TensorUnpickler(pickle.Unpickler):
    """An unpickler that builds tensors and nothing else: any other global is an UnpicklingError."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: a tensor payload may name only torch's tensor rebuilds"
            )
        return found


def deserialize(text: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of serialize and serialize_inline, in the receiving process (opens the IPC handles /
    shared memory), through TensorUnpickler: a payload naming anything but tensor rebuilds is refused."""
    named = TensorUnpickler(io.BytesIO(base64.b64decode(text, validate=True))).load()
    if not isinstance(named, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
        for x in named
    ):
        raise ValueError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return named


class TensorTransport:
    """Engines on this host receive references to the trainer's tensors (/update_weights_from_tensor)."""

    checks_in_push = False

    def __init__(self, engines: Sequence[Any], *, pause_mode: str | None = "in_place"):
        check_pause_mode(pause_mode)
        self.engines = list(engines)
        self.pause_mode = pause_mode

    @classmethod
    def from_plan(cls, plan: Any, site: Site) -> TensorTransport:
        return cls(site.engines, pause_mode=pause_mode_of(plan))

    async def setup(self) -> None:
        return None

    async def _send(self, bucket: Bucket, version: str | None) -> None:
        named = await asyncio.to_thread(pack, bucket)
        if named and named[0][1].is_cuda:
            torch.cuda.current_stream(named[0][1].device).synchronize()  # the engine reads it next
        payload = serialize(named)
        await asyncio.gather(
            *(e.update_weights_from_tensor([payload], weight_version=version) for e in self.engines)
        )
        del named  # every engine has copied: the buffer may go

    async def push(self, buckets: Iterable[Bucket], version: str) -> None:
        await push_paused(self.engines, self.pause_mode, buckets, version, self._send)

    async def close(self) -> None:
        return None
