"""The producer: turns the task's prompt stream into finished groups in the buffer.

Both schedules share one launcher:
- fully async (`run_forever`): a fixed number of sample slots (max_concurrency_per_engine x engines)
  stays busy; each finished sample frees its slot at once and the next sample starts immediately,
  possibly of the next prompt (sample-level backfill), so the engines stay at the same concurrency
  despite long-tailed response lengths. A new prompt starts only while finished plus in-flight
  groups stay below the buffer's capacity, so the buffer never holds more than its capacity.
- synchronous (`fill(n)`): the same slots, but only until n groups have been accepted; the trainer
  then trains and syncs while nothing is generated.

With `rollout.group_requests` a group's samples travel as one batched request and hold their n
slots until the group is done (less HTTP overhead; backfill per group instead of per sample).

With a generate function (`rollout.generate_fn`, `rollout.agent_fn`) a slot holds one episode; an
episode that forked returns several samples (its branches), which all join the prompt's group.
Episode facts that generate functions record in `sample.metadata["agent"]` (turns, tool calls and
errors, environment and generation time, sandbox start, branches, success) become per-step means
under `agent/`.

Prompts come in order of their index (the next index is the data position saved in checkpoints);
prompts sent back by the buffer's policy (RETRY) go first. Everything runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field

from miles.config import ConfigError
from miles.rollout.buffer import RolloutBuffer
from miles.rollout.generate import Generator, sample_group
from miles.rollout.tasks import Prompt, Task
from miles.rollout.teacher import Teacher
from miles.sample import Sample, Status

log = logging.getLogger("miles.rollout")


AGENT_KEYS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "env_s",
    "generate_s",
    "reset_s",
    "sandbox_start_s",
    "sandbox_failed",
    "verifier_s",
    "success",
    "generated",
    "demonstrations",
)
"""Per-episode facts of `sample.metadata["agent"]` reported as means (agent/<key>, times as *_time_s);
a fact no episode of the step recorded is left out."""

_AGENT_NAMES = {
    "env_s": "env_time_s",
    "generate_s": "generate_time_s",
    "reset_s": "reset_time_s",
    "verifier_s": "verifier_time_s",
}


@dataclass
class ProducerStats:
    """Counters since the last `take()`; read by the loop once per step."""

    samples: int = 0
    tokens: int = 0
    masked: int = 0
    """Samples left out of their group because they could not be scored (metadata["masked"])."""
    masked_by: dict[str, int] = field(default_factory=dict)
    """The same by reason (`rollout/masked_<reason>`: reward_not_finite, verifier_timeout, ...)."""
    since: float = field(default_factory=time.monotonic)
    episodes: dict[str, list[float]] = field(default_factory=dict)
    """Per-episode agent facts (AGENT_KEYS, plus `branches`) of the episodes finished since `take()`."""

    def add(self, samples: list[Sample]) -> None:
        """Count one finished slot: a sample, or the branches of one episode (the first carries the facts)."""
        ok = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
        self.samples += len(ok)
        self.tokens += sum(s.response_length for s in ok)
        facts = samples[0].metadata.get("agent") if samples else None
        if isinstance(facts, dict):
            for key in AGENT_KEYS:
                if isinstance(facts.get(key), (int, float)):
                    self.episodes.setdefault(key, []).append(float(facts[key]))
            self.episodes.setdefault("branches", []).append(float(len(samples)))

    def take(self) -> dict[str, float]:
        now = time.monotonic()
        elapsed = max(now - self.since, 1e-9)
        out = {
            "rollout/samples": float(self.samples),
            "rollout/tokens_per_s": self.tokens / elapsed,
            "rollout/samples_per_s": self.samples / elapsed,
        }
        if self.masked or self.episodes:  # agentic runs log it every step, 0 included
            out["rollout/masked_samples"] = float(self.masked)
        for reason, n in self.masked_by.items():
            out[f"rollout/masked_{reason}"] = float(n)
        for key, values in self.episodes.items():
            out[f"agent/{_AGENT_NAMES.get(key, key)}"] = sum(values) / len(values)
        if self.episodes:
            out["agent/episodes"] = float(len(self.episodes["branches"]))
            out["agent/episodes_per_s"] = len(self.episodes["branches"]) / elapsed
        self.samples, self.tokens, self.since, self.episodes, self.masked = 0, 0, now, {}, 0
        self.masked_by = {}
        return out


class Producer:
    """Generates groups of `n_samples` per prompt into `buffer` with `max_inflight` sample slots."""

    def __init__(
        self,
        generator: Generator,
        task: Task,
        buffer: RolloutBuffer,
        n_samples: int,
        max_inflight: int,
        next_index: int = 0,
        group_requests: bool = False,
        teacher: Teacher | None = None,
        max_masked_groups: int = 0,
    ) -> None:
        self.generator, self.task, self.buffer = generator, task, buffer
        self.teacher = teacher
        """Distillation teacher (train.distill) scoring each group before it enters the buffer."""
        self.n_samples, self.max_inflight, self.group_requests = n_samples, max_inflight, group_requests
        if group_requests and n_samples > max_inflight:
            raise ConfigError(
                f"rollout.group_requests needs rollout.n_samples_per_prompt ({n_samples}) <= samples in "
                f"flight ({max_inflight}); raise rollout.max_concurrency_per_engine"
            )
        self.next_index = next_index
        """Index of the next fresh prompt: the data position a checkpoint stores."""
        self.inflight_groups = 0
        self.max_masked_groups = max_masked_groups
        """Groups in a row with every sample masked that stop the run (0: never)."""
        self.masked_in_a_row = 0
        self.stats = ProducerStats()
        self.error: BaseException | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()
        self._group_counter = 0

    @property
    def inflight_samples(self) -> int:
        """Sample slots in use right now."""
        return 0 if self._slots is None else self.max_inflight - self._slots._value

    def _next_prompt(self) -> Prompt:
        retry = self.buffer.take_retry()
        if retry is not None:
            return retry
        prompt = self.task.train_prompt(self.next_index)
        self.next_index += 1
        return prompt

    async def _sample(
        self, prompt: Prompt, group_id: int, index: int, prompt_ids: list[int] | None
    ) -> list[Sample]:
        try:
            s = await self.generator.sample(prompt, group_id, index, prompt_ids=prompt_ids)
        finally:
            assert self._slots is not None
            self._slots.release()
        samples = [s, *s.metadata.pop("branches", [])]
        self.stats.add(samples)
        return samples

    async def _batched(self, prompt: Prompt, group_id: int, prompt_ids: list[int] | None) -> list[Sample]:
        try:
            group = await sample_group(self.generator, prompt, group_id, self.n_samples, prompt_ids)
        finally:
            assert self._slots is not None
            for _ in range(self.n_samples):
                self._slots.release()
        out = []
        for s in group:
            samples = [s, *s.metadata.pop("branches", [])]
            self.stats.add(samples)
            out.extend(samples)
        return out

    async def _group(self, prompt: Prompt, group_id: int, samples: list[asyncio.Task]) -> None:
        try:
            done = await asyncio.gather(*samples)
            group = [s for item in done for s in item]
            if self.teacher is not None:  # while other groups still generate
                await self.teacher.score(group)
            if all(s.status is Status.FAILED for s in group):
                log.warning("group %d failed on every sample: %s", group_id, group[0].metadata.get("error"))
            for s in group:  # a reward that is not a number never reaches the loss
                if not s.metadata.get("masked") and not math.isfinite(s.reward):
                    s.metadata["masked"] = "reward not finite"
            masked = [s for s in group if s.metadata.get("masked")]
            if masked:  # unscorable samples leave the group (its advantages use the others)
                self.stats.masked += len(masked)
                for s in masked:
                    reason = re.sub(r"\W+", "_", str(s.metadata["masked"])).strip("_").lower()
                    self.stats.masked_by[reason] = self.stats.masked_by.get(reason, 0) + 1
                group = [s for s in group if not s.metadata.get("masked")]
                if not group:
                    reason = masked[0].metadata["masked"]
                    log.warning("group %d: every sample masked (%s)", group_id, reason)
                    self.masked_in_a_row += 1
                    limit = self.max_masked_groups
                    if limit and self.masked_in_a_row >= limit and self.error is None:
                        self.error = RuntimeError(
                            f"the last {self.masked_in_a_row} groups had every sample masked ({reason}): no "
                            "sample can be scored; check the environment (Harbor tasks: `miles tasks check`) "
                            "or raise rollout.max_masked_groups"
                        )
                    return
            self.masked_in_a_row = 0
            self.buffer.put(group)
        except Exception as e:  # a reward function bug must stop the run, not hang it
            self.error = e
            log.exception("rollout group %d failed", group_id)
        finally:
            self.inflight_groups -= 1

    async def _launch_one(self) -> None:
        """Start one prompt's samples, each as soon as a slot frees up."""
        assert self._slots is not None
        prompt = self._next_prompt()
        group_id = self._group_counter
        self._group_counter += 1
        self.inflight_groups += 1
        # once per group (templating is slow); a generate function makes its own
        plain = self.generator.plugin is None
        prompt_ids = self.generator.encoder.prompt_ids(prompt) if plain else None
        if self.group_requests:
            for _ in range(self.n_samples):
                await self._slots.acquire()
            samples = [asyncio.create_task(self._batched(prompt, group_id, prompt_ids))]
        else:
            samples = []
            for i in range(self.n_samples):
                await self._slots.acquire()
                samples.append(asyncio.create_task(self._sample(prompt, group_id, i, prompt_ids)))
        task = asyncio.create_task(self._group(prompt, group_id, samples))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ensure_slots(self) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_inflight)

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Fully async schedule: keep every slot busy while the buffer has room, until `stop`."""
        self._ensure_slots()
        while not stop.is_set() and self.error is None:
            if len(self.buffer) + self.inflight_groups >= self.buffer.capacity:
                await asyncio.sleep(0.005)
                continue
            await self._launch_one()

    async def fill(self, n_groups: int, timeout_s: float | None = None) -> None:
        """Synchronous schedule: generate until the buffer holds n_groups accepted groups."""
        self._ensure_slots()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self.buffer) < n_groups and self.error is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"rollout: {len(self.buffer)} of {n_groups} groups after {timeout_s} s")
            if len(self.buffer) + self.inflight_groups < n_groups:
                await self._launch_one()
            else:
                await asyncio.sleep(0.002)
        if self.error is not None:
            raise self.error

    async def drain(self) -> None:
        """Wait for every started group to finish (used before a checkpoint and at shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
