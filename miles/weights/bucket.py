"""Group named tensors into buckets of at most `bucket_bytes` for transfer.

Order is preserved; a tensor larger than the limit travels alone in its own bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from miles.weights.transport import Bucket


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, keep: bool = True
) -> Iterator[Bucket]:
    """Yield lists of (name, tensor) whose total size stays <= bucket_bytes (bar single large tensors).

    With keep=False the same bucket boundaries are produced but the buckets are empty: trainer ranks
    that take part in the gathers without using the result stay in step with the one that does."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes} (set weights.bucket_mb >= 1)")
    bucket: Bucket = []
    size = count = 0
    for name, tensor in named_tensors:
        n = tensor_bytes(tensor)
        if count and size + n > bucket_bytes:
            yield bucket
            bucket, size, count = [], 0, 0
        if keep:
            bucket.append((name, tensor))
        size += n
        count += 1
    if count:
        yield bucket
