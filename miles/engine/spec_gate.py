"""Whether a decode step speculates: speculation switches itself off where it loses.

Speculation pays when the draft's proposals are kept often enough to cover the draft's forwards and the
wider verify; where they are not (an untrained draft, a policy that moved away from it, a batch large
enough to keep the GPU busy without it), a speculative round yields fewer tokens per second than a
plain decode step. The gate measures both, per batch-size bucket (the next power of two), as seconds
of wall time per generated token:

- a bucket first probes speculation for `window` steps, then plain decoding for `window` steps (the first
  step of each probe is not counted: it pays for a draft cache catching up or a CUDA graph captured),
  and keeps the faster mode;
- after `reprobe` steps in the kept mode, times how many times slower the other mode measured (so the
  probes of a mode that loses cost at most about window / reprobe of the time), it probes the other
  one again, so a draft that learns (train.draft) or a policy that drifts changes the choice;
- each probe's figure is the median of its counted steps (a step that captured a CUDA graph is an
  outlier); the kept mode's is refreshed as it runs.

While a bucket keeps plain decoding (`plain_ahead`), the engine decodes its steps one ahead of their
readback as an engine without speculation does, and they count toward the next probe.
`--speculative-max-batch` still caps the batches that may speculate at all; `--no-speculative-adaptive`
speculates in every step it allows (the acceptance benchmarks use it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW = 8
"""Counted steps of a probe."""
REPROBE = 256
"""Steps in the kept mode before the other one is probed again (times how much slower it was)."""
MAX_SPACING = 16
"""The most the reprobe interval is stretched for a mode that lost by far."""


def _key(n: int) -> int:
    """The bucket of a batch of `n` requests: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Bucket:
    cost: dict[str, float] = field(default_factory=dict)
    """Seconds per generated token of each mode ("spec", "plain") as last measured."""
    probing: str | None = "spec"
    """The mode being probed, None once a mode is kept."""
    seen: list[float] = field(default_factory=list)
    """This probe's per-token seconds so far (its first step included, then dropped)."""
    kept: str = "spec"
    since: int = 0


class Gate:
    """Per batch-size bucket, speculate or decode plainly (module docstring)."""

    def __init__(
        self, window: int = WINDOW, reprobe: int = REPROBE, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if window < 1 or reprobe < 1:
            raise ValueError(f"the gate's window ({window}) and reprobe ({reprobe}) must be at least 1")
        self.window, self.reprobe, self.clock = window, reprobe, clock
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, n: int) -> _Bucket:
        return self.buckets.setdefault(_key(n), _Bucket())

    def speculate(self, n: int) -> bool:
        """Whether the next decode step of `n` requests speculates (the step counts toward the next
        probe)."""
        b = self._bucket(n)
        if b.probing is None:
            b.since += 1
            if b.since > self._interval(b):  # probe the mode not kept
                b.probing, b.seen = ("plain" if b.kept == "spec" else "spec"), []
        return (b.probing or b.kept) == "spec"

    def plain_ahead(self, n: int) -> bool:
        """Whether steps of `n` requests decode plainly with no probe due: nothing to time or choose."""
        b = self.buckets.get(_key(n))
        return b is not None and b.probing is None and b.kept == "plain" and b.since < self._interval(b)

    def _interval(self, b: _Bucket) -> float:
        other = b.cost.get("spec" if b.kept == "plain" else "plain")
        kept = b.cost.get(b.kept)
        ratio = other / kept if other and kept else 1.0
        return self.reprobe * min(max(ratio, 1.0), MAX_SPACING)

    def record(self, n: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode step of `n` requests took `seconds` for `tokens` generated tokens."""
        if tokens <= 0:
            return
        b, mode = self._bucket(n), "spec" if speculated else "plain"
        per_token = seconds / tokens
        if b.probing != mode:
            if b.probing is None and mode == b.kept:  # the kept mode's figure follows it (an outlier, a
                was = b.cost.get(mode, per_token)  # CUDA graph captured, moves it at most 10%)
                b.cost[mode] = 0.9 * was + 0.1 * min(per_token, 2 * was)
            return
        b.seen.append(per_token)
        if len(b.seen) <= self.window:
            return
        b.cost[mode] = statistics.median(b.seen[1:])  # the first step left out; a CUDA graph captured
        # in a later step (a longer context) is one outlier the median ignores
        b.seen = []
        if "plain" not in b.cost:  # the first probes: speculation, then plain decoding
            b.probing = "plain"
            return
        b.probing, b.since = None, 0
        b.kept = "spec" if b.cost["spec"] < b.cost["plain"] else "plain"
