"""The three evaluation modes (`eval.mode`) and the bookkeeping that ties each result to its step.

- `shared`: on the rollout engines, between training steps, right after the step's weights were
  pushed (the fully async producer stops submitting for it); results belong to that step at once.
- `dedicated`: the trainer ranks export a snapshot of the step's weights (miles/eval/snapshot.py);
  eval engines of their own load it (`/update_weights_from_disk`, version = step) and evaluate
  while training goes on (miles/eval/runner.py: DedicatedRunner).
- `external`: the same snapshot is handed to a user function (`eval.external_fn`) in a process of
  its own (ExternalRunner), while training goes on.

`Evaluations` (trainer rank 0, dedicated/external) keeps the evaluations in flight. At each step
boundary the loop asks it for finished ones and adds them to the record of the step whose weights
they measured (MetricsLogger.amend), in step order, with

    eval/lag_steps          training steps completed between the snapshot and the result
    eval/export_s           seconds the trainer spent on the snapshot: the step's exported weights
                            copied to host memory (the only part on the training path)
    eval/snapshot_write_s   seconds a background thread took to write that copy as a complete
                            snapshot on disk; the evaluation starts once it is complete
    eval/duration_s         seconds the evaluation itself took (weights load included)
    eval/mixed_version_ratio  evaluated tokens whose engine weight version was not the step's
                            (shared, dedicated; must be 0)
    eval/skipped_<reason>   evaluations skipped so far for that reason: overflow (more than
                            eval.max_in_flight pending and eval.overflow=skip), error (it raised),
                            crash (its process died), timeout (over eval.timeout_s), engine_lost

A failed evaluation never stops training: it is logged, counted and skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from miles.config import Plan
from miles.eval.shared import evaluate_suites
from miles.eval.snapshot import eval_dir, export_snapshot, prune, read_marker, snapshot_dir
from miles.rollout.client import GenerateResult
from miles.rollout.generate import Generator
from miles.sample import Sample

log = logging.getLogger("miles.eval")

SKIP_REASONS = ("overflow", "error", "crash", "timeout", "engine_lost")


class EvalSkipped(Exception):
    """An evaluation that produced no result; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class TokenVersions:
    """Counts evaluated tokens and those whose weight version differs from `expected`."""

    expected: int = 0
    tokens: int = 0
    other: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self, expected: int) -> None:
        with self._lock:
            self.expected, self.tokens, self.other = expected, 0, 0

    def add(self, versions: Iterable[int]) -> None:
        vs = list(versions)
        with self._lock:
            self.tokens += len(vs)
            self.other += sum(v != self.expected for v in vs)

    @property
    def ratio(self) -> float:
        return self.other / self.tokens if self.tokens else 0.0


@dataclass
class CountingGenerator(Generator):
    """A Generator that records the weight version of every token it receives (`tally`); copies made
    with dataclasses.replace share the tally."""

    tally: TokenVersions = field(default_factory=TokenVersions)

    async def fill(self, s: Sample, r: GenerateResult) -> None:
        await super().fill(s, r)
        self.tally.add(s.weight_versions)

    @classmethod
    def like(cls, gen: Generator, **changes: Any) -> CountingGenerator:
        """A counting generator on `gen`'s engines, encoder, reward and sampling (its own gate)."""
        fields = {f.name: getattr(gen, f.name) for f in dataclasses.fields(Generator) if f.name != "ready"}
        new = cls(**{**fields, **changes})
        for key, value in vars(gen).items():  # attributes set after construction (plug-ins, ...)
            if key not in vars(new):
                setattr(new, key, value)
        return new


async def evaluate_step(
    generator: CountingGenerator, suites: list[Any], step: int, out_dir: Path
) -> dict[str, float]:
    """Evaluate every suite (miles.eval.datasets.build_suites) on the engines behind `generator`, which
    serve the weights of `step`; eval/* metrics including eval/mixed_version_ratio, per-sample records
    under `out_dir` (RUN_DIR/eval). Raises when every request failed."""
    generator.tally.reset(step)
    start = time.monotonic()
    metrics = await evaluate_suites(generator, suites, step, out_dir)
    metrics["eval/mixed_version_ratio"] = generator.tally.ratio
    metrics["eval/duration_s"] = time.monotonic() - start
    if generator.tally.other:
        log.error(
            "evaluation of step %d: %d of %d tokens came from other weight versions",
            step,
            generator.tally.other,
            generator.tally.tokens,
        )
    return metrics


@dataclass
class EvalJob:
    """One evaluation of the snapshot of `step`."""

    step: int
    snapshot: Path
    export_s: float
    started: float = field(default_factory=time.monotonic)
    writing: Future | None = None
    """The background write of the snapshot; None once it is complete and the evaluation started."""
    write_s: float = 0.0
    handle: Any = None
    """The runner's handle (a Future, a process)."""
    result: dict[str, float] | None = None
    skipped: EvalSkipped | None = None

    @property
    def out_dir(self) -> Path:
        return eval_dir(self.snapshot.parents[2], self.step)


class Runner(Protocol):
    """Runs evaluations of complete snapshots off the training thread.

    `start` returns at once; `poll` returns None while the job runs, its eval/* metrics when done,
    or raises EvalSkipped (never anything else); `stop` ends everything the runner started."""

    def start(self, job: EvalJob) -> None: ...
    def poll(self, job: EvalJob) -> dict[str, float] | None: ...
    def stop(self) -> None: ...


class Evaluations:
    """Rank 0's evaluations in flight (dedicated and external modes); see the module docstring."""

    def __init__(self, plan: Plan, run_dir: Path, runner: Runner) -> None:
        self.plan, self.run_dir, self.runner = plan, run_dir, runner
        self.cfg = plan.eval
        self.jobs: list[EvalJob] = []
        """Submitted and not yet reported, in step order."""
        self.skipped: Counter[str] = Counter()
        self.reported: list[int] = []
        """Steps whose evaluation was reported and whose snapshots are kept (eval.keep_snapshots)."""
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-snapshot")
        """Writes snapshots to disk, and deletes those no longer kept, off the training path, one at
        a time, in order."""

    @property
    def running(self) -> list[EvalJob]:
        return [j for j in self.jobs if j.result is None and j.skipped is None]

    def admit(self, step: int, last: bool = False) -> tuple[bool, dict[str, float]]:
        """Room for an evaluation of `step`? With eval.overflow=wait, or at the last step (training
        is over: waiting costs it nothing), waits until there is, at most half of
        train.collective_timeout_s (the other ranks wait in a collective meanwhile); with skip, or
        once that wait is over, says no and counts it. Returns (export a snapshot?, metrics for this
        step's record)."""
        deadline = time.monotonic() + self.plan.train.collective_timeout_s / 2
        self._poll()  # one that finished since the last step makes room
        while len(self.running) >= self.cfg.max_in_flight:
            if (self.cfg.overflow == "skip" and not last) or time.monotonic() > deadline:
                self.skipped["overflow"] += 1
                log.warning("evaluation of step %d skipped: %d still running", step, len(self.running))
                return False, {"eval/skipped_overflow": float(self.skipped["overflow"])}
            self._poll()
            time.sleep(0.05)
        return True, {}

    def submit(self, step: int, buckets: Iterable[Any]) -> None:
        """Copy the exported buckets of `step` to host memory (consuming them: the export is collective)
        and write its snapshot from that copy in a background thread; the evaluation starts in `_poll`
        once the snapshot is complete. Host memory holds one copy of the weights per snapshot being
        written (at most eval.max_in_flight)."""
        start = time.monotonic()
        host = [[(name, t.detach().to("cpu", copy=True)) for name, t in bucket] for bucket in buckets]
        job = EvalJob(step, snapshot_dir(self.run_dir, step), time.monotonic() - start)
        job.writing = self._writer.submit(export_snapshot, host, self.run_dir, step, self.plan.model.path)
        self.jobs.append(job)
        self._poll()

    def _start(self, job: EvalJob) -> None:
        """The snapshot of `job` is written (or its write failed): start its evaluation."""
        writing, job.writing = job.writing, None
        try:
            writing.result()
        except Exception as e:
            log.warning("evaluation of step %d skipped: its snapshot was not written: %s", job.step, e)
            job.skipped = EvalSkipped("error", f"snapshot not written: {e}")
            return
        job.write_s = float((read_marker(job.snapshot) or {}).get("export_s", 0.0))
        job.started = time.monotonic()
        job.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.runner.start(job)
        except Exception as e:
            log.warning("evaluation of step %d could not start: %s", job.step, e)
            job.skipped = e if isinstance(e, EvalSkipped) else EvalSkipped("error", str(e))

    def _poll(self) -> None:
        for job in self.running:
            if job.writing is not None:
                if not job.writing.done():
                    continue
                self._start(job)
                if job.skipped is not None:
                    continue
            try:
                job.result = self.runner.poll(job)
            except EvalSkipped as e:
                log.warning("evaluation of step %d skipped (%s)", job.step, e)
                job.skipped = e

    def collect(self, current_step: int) -> list[tuple[int, dict[str, float]]]:
        """Finished evaluations, in step order (a later one waits for earlier ones), as (step, metrics)."""
        self._poll()
        out = []
        while self.jobs and (self.jobs[0].result is not None or self.jobs[0].skipped is not None):
            job = self.jobs.pop(0)
            out.append((job.step, self._report(job, current_step)))
            self.reported.append(job.step)
        if out:  # deleted by the writer thread, after the snapshots queued before (off the training path)
            steps, keep = sorted(set(self.reported)), self.cfg.keep_snapshots
            self._writer.submit(prune, self.run_dir, steps, {j.step for j in self.jobs}, keep)
            self.reported = steps[len(steps) - keep :] if keep else []  # the snapshots left
        return out

    def _report(self, job: EvalJob, current_step: int) -> dict[str, float]:
        if job.skipped is not None:
            self.skipped[job.skipped.reason] += 1
            reason = job.skipped.reason
            return {f"eval/skipped_{reason}": float(self.skipped[reason]), "eval/export_s": job.export_s}
        assert job.result is not None
        metrics = dict(job.result)
        metrics.setdefault("eval/duration_s", time.monotonic() - job.started)
        metrics.update({"eval/lag_steps": float(current_step - job.step), "eval/export_s": job.export_s})
        metrics["eval/snapshot_write_s"] = job.write_s
        return metrics

    def drain(self, current_step: int) -> list[tuple[int, dict[str, float]]]:
        """Wait for every evaluation in flight (the run is over), then report them all."""
        while self.running:
            self._poll()
            time.sleep(0.1)
        return self.collect(current_step)

    def close(self) -> None:
        self._writer.shutdown(wait=True)  # a snapshot being written is finished (its marker last)
        self.runner.stop()
