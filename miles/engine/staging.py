"""What the engine's overlapped decode keeps between two steps (see miles/engine/scheduler.py).

With overlap the host launches decode step k+1 before it reads step k's tokens back. `InFlight` is a
launched step whose tokens are still on their way; `Staging` moves each step's small inputs to the
device and its sampled tokens back through pinned buffers, so that neither copy waits for the GPU
to finish the work queued before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from miles.engine.logprobs import StepRows
    from miles.engine.request import Request


@dataclass
class InFlight:
    """A decode step launched on the device whose sampled tokens the host has not read yet."""

    reqs: list[Request]
    """The step's requests, in the order of its rows."""
    tokens: torch.Tensor
    """[B] on the device: the next step's input."""
    host: tuple[torch.Tensor, torch.Tensor]
    """Tokens and log-probs on their way to host memory, readable once `ready` has passed."""
    ready: torch.cuda.Event | None
    version: str
    rows: StepRows | None = None
    """Extra log-prob rows of the requests that ask for them, copied beside the tokens."""
    head: np.ndarray | None = None
    """The step's first input rows on the host, int64 [4, B]: ids (or indices), positions, rows, slots."""
    hidden: torch.Tensor | None = None
    """[B, h] the step's final hidden states, kept for a speculating engine's MTP draft, else None."""

    def read(self) -> tuple[list[int], list[float]]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[0].tolist(), self.host[1].tolist()


class Staging:
    """Copies of a step's small inputs to the device and of its sampled tokens back, without waiting
    for the stream: a copy to or from pageable memory waits for all the work queued before it (with
    overlap, the step just launched), and fresh pinned memory per step is slow to allocate while
    earlier copies are pending. So a few pinned buffers (and device twins for the inputs) are used
    in turn; an input buffer is rewritten only after its last copy ran, an output buffer is read
    (`InFlight.read`) long before its turn comes again."""

    def __init__(self, device: torch.device, width: int, depth: int = 4, rows: int = 8):
        self.next = 0
        pinned = dict(pin_memory=True)
        self.host = [
            (torch.empty(rows, width, dtype=torch.int64, **pinned), torch.empty(2, width, **pinned))
            for _ in range(depth)
        ]
        self.dev = [(i.to(device), f.to(device)) for i, f in self.host]
        self.copied = [torch.cuda.Event() for _ in range(depth)]
        self.out = [
            (torch.empty(width, dtype=torch.int64, **pinned), torch.empty(width, **pinned))
            for _ in range(depth)
        ]
        self.fetched = [torch.cuda.Event() for _ in range(depth)]
        self.next_out = 0

    def fetch(self, tokens: torch.Tensor, logps: torch.Tensor):
        """Start copying a step's tokens and log-probs to host memory: ((tokens, logps), event)."""
        k, self.next_out = self.next_out, (self.next_out + 1) % len(self.out)
        n = tokens.shape[0]
        ht, hl = self.out[k][0][:n], self.out[k][1][:n]
        ht.copy_(tokens, non_blocking=True)
        hl.copy_(logps, non_blocking=True)
        self.fetched[k].record()
        return (ht, hl), self.fetched[k]

    def put(self, ints: torch.Tensor, floats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, self.next = self.next, (self.next + 1) % len(self.host)
        self.copied[k].synchronize()
        (hi, hf), (di, df) = self.host[k], self.dev[k]
        (r, n), m = ints.shape, floats.shape[0]
        hi[:r, :n].copy_(ints)
        hf[:m, :n].copy_(floats)
        di[:r, :n].copy_(hi[:r, :n], non_blocking=True)
        df[:m, :n].copy_(hf[:m, :n], non_blocking=True)
        self.copied[k].record()
        return di[:r, :n], df[:m, :n]
