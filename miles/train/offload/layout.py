"""How the optimiser state of a list of parameters is cut into buckets, and the byte image of one bucket.

Parameters are laid end to end as one flat sequence of elements and cut every `capacity` elements;
a large parameter (an embedding) is split across buckets, which is exact because AdamW is
element-wise. A bucket's image holds one region per state field (exp_avg, exp_avg_sq, and the fp32
master copy when parameters are not fp32), each region starting on a 4 KiB boundary, so the same
image is a file on NVMe, a staging buffer for O_DIRECT I/O, and a pinned host buffer in cpu mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.train.offload.checks import ALIGN

ELEMENT_QUANTUM = 1024
"""Bucket capacities are multiples of this many elements (keeps cuts away from odd offsets)."""


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of parameter `param`, at element `offset` of its bucket."""

    param: int
    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class Field:
    """One state tensor of a bucket: its name, storage dtype and byte offset in the image."""

    name: str
    dtype: torch.dtype
    offset: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of parameter elements and where each state field sits in its image."""

    index: int
    numel: int
    pieces: tuple[Piece, ...]
    fields: tuple[Field, ...]
    nbytes: int

    def views(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed 1-D views of each field inside a uint8 image (host or device) of this bucket."""
        out = {}
        for f in self.fields:
            size = self.numel * _itemsize(f.dtype)
            out[f.name] = image[f.offset : f.offset + size].view(f.dtype)
        return out

    def signature(self) -> dict:
        """A JSON-able description, compared on load so a checkpoint only loads into the same layout."""
        return {
            "numel": self.numel,
            "nbytes": self.nbytes,
            "fields": [[f.name, str(f.dtype).removeprefix("torch."), f.offset] for f in self.fields],
            "pieces": [[p.param, p.start, p.numel, p.offset] for p in self.pieces],
        }


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def align_up(n: int, align: int = ALIGN) -> int:
    """The smallest multiple of `align` that is >= n."""
    return -(-n // align) * align


def _fields_for(numel: int, fields: list[tuple[str, torch.dtype]]) -> tuple[tuple[Field, ...], int]:
    out, offset = [], 0
    for name, dtype in fields:
        out.append(Field(name, dtype, offset))
        offset += align_up(numel * _itemsize(dtype))
    return tuple(out), offset


def plan_buckets(numels: list[int], bucket_bytes: int, fields: list[tuple[str, torch.dtype]]) -> list[Bucket]:
    """Cut parameters with the given element counts into buckets of at most ~bucket_bytes of state."""
    per_element = sum(_itemsize(d) for _, d in fields)
    capacity = max(ELEMENT_QUANTUM, bucket_bytes // per_element // ELEMENT_QUANTUM * ELEMENT_QUANTUM)
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    filled = 0

    def close() -> None:
        nonlocal pieces, filled
        laid, nbytes = _fields_for(filled, fields)
        buckets.append(Bucket(len(buckets), filled, tuple(pieces), laid, nbytes))
        pieces, filled = [], 0

    for param, numel in enumerate(numels):
        start = 0
        while start < numel:
            take = min(numel - start, capacity - filled)
            pieces.append(Piece(param, start, take, filled))
            start += take
            filled += take
            if filled == capacity:
                close()
    if filled:
        close()
    return buckets


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of nbytes whose data pointer is 4 KiB aligned (pinned if asked)."""
    if pin:
        # the pinned allocator rounds sizes up to a power of two and returns page-aligned blocks:
        # asking for nbytes + ALIGN could double the pinned memory of a power-of-two bucket
        exact = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if exact.data_ptr() % ALIGN == 0:
            return exact
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]
