"""The bounded rollout buffer between the producer (generation) and the trainer.

Finished groups (all samples of one prompt) are `put`; the trainer calls `get(n, current_version)`
for a batch of n groups. Which groups are kept is decided by a policy, a plain function in the
POLICIES dict (or any `module:function`), never by branches inside the buffer:

    policy(group, staleness, max_staleness) -> Verdict (KEEP, DROP or RETRY)

It is asked twice per group: on `put` with staleness None (content checks, e.g. dynamic sampling)
and on `get` with staleness = current_version - min(weight version of any token in the group)
(freshness checks). DROP discards the group; RETRY discards it and queues its prompt for
generation again (the producer takes it back with `take_retry`).

Capacity bounds the finished groups held; `put` never blocks: the producer starts a new group only
while finished plus in-flight groups stay below capacity, so its event loop is never stalled by the
trainer and the bound holds.
The buffer is shared between the producer's thread and the trainer's thread: one lock guards it.
"""

from __future__ import annotations

import enum
import importlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from miles.config import ConfigError
from miles.sample import Sample, Status

Group = list[Sample]


class Verdict(enum.Enum):
    KEEP = "keep"
    DROP = "drop"
    RETRY = "retry"


Policy = Callable[[Group, "int | None", int], Verdict]


def group_staleness(group: Group, current_version: int) -> int:
    """current version - oldest weight version that produced any token of the group."""
    return current_version - min(s.oldest_version for s in group)


def keep(group: Group, staleness: int | None, max_staleness: int) -> Verdict:
    """Keep everything (staleness is only measured)."""
    return Verdict.KEEP


def drop_stale(group: Group, staleness: int | None, max_staleness: int) -> Verdict:
    """Reject groups staler than max_staleness."""
    return Verdict.DROP if staleness is not None and staleness > max_staleness else Verdict.KEEP


def retry_stale(group: Group, staleness: int | None, max_staleness: int) -> Verdict:
    """Regenerate the prompt of groups staler than max_staleness."""
    return Verdict.RETRY if staleness is not None and staleness > max_staleness else Verdict.KEEP


def dynamic_sampling(group: Group, staleness: int | None, max_staleness: int) -> Verdict:
    """Drop groups whose rewards all agree (zero variance: no GRPO signal), and stale groups."""
    if staleness is None:
        rewards = {s.reward for s in group}
        return Verdict.DROP if len(rewards) <= 1 else Verdict.KEEP
    return drop_stale(group, staleness, max_staleness)


POLICIES: dict[str, Policy] = {
    "keep": keep,
    "drop_stale": drop_stale,
    "retry_stale": retry_stale,
    "dynamic_sampling": dynamic_sampling,
}


def load_policy(spec: str) -> Policy:
    """A policy by name (POLICIES) or `module:function`; errors name rollout.buffer_policy."""
    if spec in POLICIES:
        return POLICIES[spec]
    module_name, sep, fn_name = spec.partition(":")
    if not sep:
        raise ConfigError(
            f"rollout.buffer_policy={spec!r} is unknown; known: {', '.join(POLICIES)} or module:function"
        )
    try:
        fn = getattr(importlib.import_module(module_name), fn_name, None)
    except ImportError as e:
        raise ConfigError(f"rollout.buffer_policy={spec!r}: cannot import {module_name!r} ({e})") from None
    if not callable(fn):
        raise ConfigError(f"rollout.buffer_policy={spec!r}: {module_name} has no function {fn_name!r}")
    return fn


class RolloutBuffer:
    """Bounded FIFO of finished groups with a pluggable keep/drop/retry policy."""

    capacity: int
    max_staleness: int
    policy: Policy

    def __init__(self, capacity: int, policy: Policy = keep, max_staleness: int = 1) -> None:
        if capacity < 1:
            raise ConfigError(f"rollout.buffer_capacity_groups must be >= 1 (got {capacity})")
        self.capacity, self.policy, self.max_staleness = capacity, policy, max_staleness
        self._groups: deque[Group] = deque()
        self._retries: deque[Any] = deque()
        self._cond = threading.Condition()
        self._counts = {"put": 0, "taken": 0, "dropped": 0, "retried": 0, "dropped_stale": 0}
        self._taken_staleness: list[int] = []

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def has_room(self) -> bool:
        with self._cond:
            return len(self._groups) < self.capacity

    def put(self, group: Group) -> bool:
        """Offer a finished group; returns whether it was kept. Aborted/failed groups are retried."""
        if any(s.status in (Status.ABORTED, Status.FAILED) for s in group):
            verdict = Verdict.RETRY
        else:
            verdict = self.policy(group, None, self.max_staleness)
        with self._cond:
            self._counts["put"] += 1
            if verdict is Verdict.KEEP:
                self._groups.append(group)
                self._cond.notify_all()
            else:
                self._reject(group, verdict, stale=False)
            return verdict is Verdict.KEEP

    def _reject(self, group: Group, verdict: Verdict, stale: bool) -> None:
        if verdict is Verdict.RETRY:
            self._counts["retried"] += 1
            self._retries.append(group[0].metadata.get("prompt"))
        else:
            self._counts["dropped_stale" if stale else "dropped"] += 1

    def take_retry(self) -> Any:
        """The oldest prompt sent back for regeneration, or None (the producer calls this)."""
        with self._cond:
            while self._retries:
                prompt = self._retries.popleft()
                if prompt is not None:
                    return prompt
            return None

    def get(self, n: int, current_version: int, timeout_s: float | None = None) -> list[Group]:
        """Block until n groups pass the policy at `current_version`; oldest first.

        Raises TimeoutError after timeout_s (None: wait forever).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out: list[Group] = []
        with self._cond:
            while len(out) < n:
                while self._groups and len(out) < n:
                    group = self._groups.popleft()
                    staleness = group_staleness(group, current_version)
                    verdict = self.policy(group, staleness, self.max_staleness)
                    if verdict is Verdict.KEEP:
                        out.append(group)
                        self._taken_staleness.append(staleness)
                    else:
                        self._reject(group, verdict, stale=True)
                    self._cond.notify_all()
                if len(out) < n:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._groups.extendleft(reversed(out))
                        raise TimeoutError(f"buffer: {len(out)} of {n} groups after {timeout_s} s")
                    self._cond.wait(left if left is not None else 1.0)
            self._counts["taken"] += len(out)
        return out

    def metrics(self) -> dict[str, float]:
        """Queue size, counters since the start, staleness of the groups taken since the previous call."""
        with self._cond:
            stale = self._taken_staleness or [0]
            out = {
                "buffer/size": float(len(self._groups)),
                "buffer/retry_queue": float(len(self._retries)),
                "staleness/mean": sum(stale) / len(stale),
                "staleness/max": float(max(stale)),
                **{f"buffer/{k}": float(v) for k, v in self._counts.items()},
            }
            self._taken_staleness = []
            return out
