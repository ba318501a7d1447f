"""The loop's state across steps and restarts: step, data position, metrics file, preemption.

What survives a restart: the trainer checkpoint (model, optimiser, schedule, RNG) and, in its
`extra`, {"step", "data_index"} (the index of the next fresh prompt). Groups that were buffered or
in flight at checkpoint time are not trained on after a resume (their prompts are skipped, never
trained twice). metrics.jsonl is cut back to the checkpoint's step when the run resumes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from miles.config import Plan
from miles.metrics import MetricsLogger, read_metrics

if TYPE_CHECKING:
    from miles.loop.rollout_side import RolloutSide
    from miles.sample import Sample
    from miles.train.backend import TrainBackend
    from miles.weights.transport import Bucket

log = logging.getLogger("miles.loop")


def setup_logging(run_dir: Path, rank: int) -> logging.Logger:
    """Log to RUN_DIR/logs/trainer-<rank>.log and stderr."""
    path = run_dir / "logs" / f"trainer-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    root = logging.getLogger("miles")
    root.setLevel(logging.INFO)
    for handler in (logging.FileHandler(path), logging.StreamHandler(sys.stderr)):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    return log


def broadcast(obj: Any) -> Any:
    """Rank 0's object on every rank (pickled over the default group)."""
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier_flag(flag: bool) -> bool:
    """Rank 0's boolean on every rank (all ranks must agree to stop together)."""
    return bool(broadcast(flag))


def _recorded_progress(run_dir: Path) -> str | None:
    """What of an earlier start of this run is on disk (metrics after step 0, checkpoint directories)."""
    last = max((int(r.get("step", 0)) for r in read_metrics(run_dir)), default=0)
    if last > 0:
        return f"metrics up to step {last}"
    root = run_dir / "checkpoints"
    if root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir()):
        return f"checkpoint directories in {root}"
    return None


@dataclass
class LoopState:
    """Step counter, data position and the rank-0 metrics logger."""

    run_dir: Path
    step: int = 0
    data_index: int = 0
    logger: MetricsLogger | None = None
    eval_due: bool = False
    """An evaluation is owed; it runs at the next step whose weights reach the engines."""

    @property
    def preempt_file(self) -> Path:
        return self.run_dir / "control" / "preempt"

    @classmethod
    def restore(
        cls, backend: TrainBackend, plan: Plan, run_dir: Path, resume: bool, rank0: bool
    ) -> LoopState:
        """Fresh start, or (resume) load the newest checkpoint that verifies; damaged newer ones are
        skipped with a warning. Resuming a run that recorded progress (metrics after step 0, a
        checkpoint directory) without a usable checkpoint raises NoCheckpointError; a run directory
        with neither is the run's first start (every Slurm start passes --resume) and starts fresh."""
        state = cls(run_dir)
        resumed = resume and state._resume(backend, rank0)
        if rank0:
            state.preempt_file.unlink(missing_ok=True)
            state.logger = MetricsLogger(
                run_dir, tensorboard=plan.run.tensorboard, resume_step=state.step if resumed else None
            )
        return state

    def _resume(self, backend: TrainBackend, rank0: bool) -> bool:
        """Load the newest usable checkpoint (collective); False: nothing was recorded to resume."""
        from miles.train.checkpoint import NoCheckpointError

        try:
            extra = backend.load(None)
        except NoCheckpointError as exc:
            progress = broadcast(_recorded_progress(self.run_dir) if rank0 else None)
            if progress is None:
                log.info(
                    "--resume: %s holds no checkpoint and no step yet: the run's first start", self.run_dir
                )
                return False
            raise NoCheckpointError(
                f"--resume: no usable checkpoint in {self.run_dir}, which holds {progress}: {exc}\n"
                "start without --resume to begin a fresh run in it"
            ) from exc
        if "step" not in extra:
            raise NoCheckpointError(
                f"--resume: the checkpoint in {self.run_dir} has no loop position (its extra state has "
                "no 'step': it was not written by the RL loop); start without --resume"
            )
        self.step, self.data_index = int(extra["step"]), int(extra.get("data_index") or 0)
        log.info("resumed from checkpoint step %d (data index %d)", self.step, self.data_index)
        return True

    def rollout_side(self, plan: Plan, run_dir: Path) -> RolloutSide:
        from miles.loop.rollout_side import RolloutSide

        side = RolloutSide(plan, run_dir)
        side.start(self.data_index)
        return side

    def push_weights(self, plan: Plan, backend: TrainBackend, side: RolloutSide | None) -> dict[str, float]:
        """Export (collective on every rank) and push weights of version `step` into the engines; with
        `weights.check`, the check as metrics (from the push itself when the transport verifies)."""
        from miles.weights import get_transport

        start = time.monotonic()
        bucket_bytes = plan.weights.bucket_mb << 20
        sent = [0]

        def counted(buckets: Iterable[Bucket]) -> Iterator[Bucket]:
            for bucket in buckets:
                sent[0] += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        buckets = counted(backend.export_weights(bucket_bytes))
        if side is not None:
            side.push(buckets, self.step)
        else:
            for _ in buckets:
                pass
        out = {"weights/version": float(self.step), "weights/push_s": time.monotonic() - start}
        if sent[0]:  # the rank that holds the exported tensors
            out["weights/push_bytes"] = float(sent[0])
        if plan.weights.check and get_transport(plan.weights.transport).checks_in_push:
            out["weights/checksum_mismatch"] = 0.0  # each engine checked the bytes it stored in the push
        elif plan.weights.check:  # a second export, compared with what the engines now serve
            buckets = backend.export_weights(bucket_bytes)
            if side is not None:
                out.update(side.check_metrics(buckets))
            else:
                for _ in buckets:
                    pass
        return out

    def rollout_metrics(self, samples: list[Sample]) -> dict[str, float]:
        from miles.loop.rollout_side import batch_metrics

        return batch_metrics(samples)

    def preempt_requested(self) -> bool:
        return self.preempt_file.exists()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self.logger is not None
        self.logger.log(step, metrics)

    def save(self, backend: TrainBackend, side: RolloutSide | None) -> None:
        """Complete checkpoint of this step with the data position (collective)."""
        index = broadcast(side.producer.next_index if side is not None else None)
        path = backend.save(self.step, {"step": self.step, "data_index": index})
        log.info("checkpoint of step %d written to %s", self.step, path)

    def close(self, side: RolloutSide | None) -> None:
        if side is not None:
            side.stop()
        if self.logger is not None:
            self.logger.close()
