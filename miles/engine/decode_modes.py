"""How the scheduler records a decode step: at once (`InStep`), or one step ahead of its readback
(`StepAhead`, the default on CUDA). miles/engine/scheduler.py holds one as `Scheduler.decoding`.

With `StepAhead` the host launches step k+1 with step k's sampled tokens as its input, still on the
device, and only then reads step k's tokens back and records them, so the host's per-request work
runs while the GPU computes. A request that finishes at step k has already been put into step k+1;
that extra token is dropped and its slot freed (stream order keeps the slot's later owner safe).
Anything else (admitting, prefill, pause, weight updates, memory release) first lands the step in
flight (`land`). While a request with per-step options runs (miles/engine/options.py), steps are
recorded at once under either mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.engine.logprobs import step_rows
from miles.engine.staging import InFlight

if TYPE_CHECKING:
    from miles.engine.request import Request
    from miles.engine.scheduler import Scheduler


class InStep:
    """Each decode step's tokens are read back and recorded before the next step starts."""

    inflight: InFlight | None = None
    """The launched step whose tokens are not recorded yet (never, in this mode)."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler

    def take(self, reqs: list[Request], logits: torch.Tensor, ints, floats, head: np.ndarray) -> None:
        """After a decode forward: sample one token per request and record it."""
        self.s._sample(reqs, logits, (ints[4:], floats))

    def advance(self) -> bool:
        """Launch the next step from the one in flight; False: nothing launched (none in flight)."""
        return False

    def land(self) -> None:
        """Record the step in flight, if any."""


class StepAhead(InStep):
    """Decode one step ahead of the readback (module docstring)."""

    def take(self, reqs: list[Request], logits: torch.Tensor, ints, floats, head: np.ndarray) -> None:
        """Sample on the device and leave the tokens in flight (recorded at once while a request with
        per-step options runs)."""
        s = self.s
        if s._special or s._in_step(len(reqs)):
            return s._sample(reqs, logits, (ints[4:], floats))
        tokens, logps = s._sample_on_device(reqs, logits, (ints[4:], floats))
        rows = step_rows(reqs, logits, floats[0]) if s._rows else None
        if s._staging is None:  # CPU (tests): nothing to copy
            host, ready = (tokens, logps), None
        else:  # rows queued before the tokens' readback event, which then covers both
            rows = rows.to_host(s._row_buffers) if rows is not None else None
            host, ready = s._staging.fetch(tokens, logps)
        hidden = s.decoder.hidden  # an MTP draft's input, which the next step's forward overwrites
        hidden = hidden.clone() if s.speculator is not None and hidden is not None else None
        self.inflight = InFlight(reqs, tokens, host, ready, s.weight_version, rows, head, hidden)

    def advance(self) -> bool:
        """Launch the next decode step of the requests in flight from their device-side tokens, then
        record the step in flight. False (nothing launched) when the pool is full or none goes on."""
        s, prev = self.s, self.inflight
        if s._special:
            return False
        keep = self._going_on(prev.reqs)
        if keep is None:
            return False  # requests joined since (their first decode goes with everyone's, landed)
        if s._in_step(len(keep)):
            return False  # a batch a speculating engine may speculate in: landed, then its own choice
        reqs = [prev.reqs[i] for i in keep]
        fresh = s.slots.allocate(len(reqs)) if reqs else None
        if fresh is None:
            return False
        for req, slot in zip(reqs, fresh, strict=True):
            req.slots.append(slot)
        # each request one position on from the step in flight, in the same row; row 0 first holds
        # where each request sits in the step in flight, then its token from there
        at = np.array(keep, dtype=np.int64)
        head = np.stack([at, prev.head[1, at] + 1, prev.head[2, at], np.array(fresh, dtype=np.int64)])
        context = s._decode_context(int(head[1].max()) + 1)
        ints, floats = s._to_device(s._constants.decode_rows(head))
        ints[0].copy_(prev.tokens.index_select(0, ints[0]))
        s.table[ints[2], ints[1]] = ints[3]
        s._launch_decode(reqs, ints, floats, context, head)
        s._record_rows(prev.reqs, *prev.read(), prev.version, prev.rows)
        s._landed(prev)
        return True

    def _going_on(self, reqs: list[Request]) -> list[int] | None:
        """Indices of the requests still running after the step in flight lands (not finished earlier,
        not certain to stop now); None when requests joined the batch since it was launched."""
        keep, live, max_context = [], 0, self.s.max_context
        for i, r in enumerate(reqs):
            if r.finish is not None:
                continue
            live += 1
            n = len(r.output) + 1
            if not r.abort_requested and n < r.params.max_new_tokens and len(r.prompt) + n < max_context:
                keep.append(i)
        return keep if live == len(self.s.running) else None

    def land(self) -> None:
        """Record the decode step in flight, if any (waits for the device)."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.s._record_rows(prev.reqs, *prev.read(), prev.version, prev.rows)
            self.s._landed(prev)
