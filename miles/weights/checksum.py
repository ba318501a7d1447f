"""The tensor hash both sides of a weight push compute: SGLang's host tensor hash.

sha256 of the tensor's raw C-order bytes, the first 8 bytes as 16 hex digits. The trainer hashes the
bytes it sends, the engine the bytes it stores (`/weights_checker`, `expected_checksums`), so equal
hashes mean the engine serves exactly what was sent, whatever the dtype (bf16, FP8 pairs, packed
formats, LoRA adapters).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def checksum(t: Tensor) -> str:
    """SGLang's host tensor hash: sha256 of the raw C-order bytes, first 8 bytes as 16 hex digits."""
    host = t.detach().cpu().contiguous()
    data = host.reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()[:16]
