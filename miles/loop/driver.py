"""The RL loop's driver, run on every trainer rank: `python -m miles.loop --run-dir RUN_DIR [--resume]`.

    for step: batch <- buffer (rank 0, sync or fully async)  -> broadcast to all ranks
              [colocated + sync: engines release their GPU memory] train(batch) [engines resume it]
              (engine.release_memory_in_train=false: they stay resident)
              -> every `weights.update_interval` steps push weights (version = step)
              -> evaluate every `eval.every_steps` -> metrics.jsonl -> checkpoint / preemption
              -> evaluations finished meanwhile (dedicated / external) -> the records of their steps

An engine lost on the way (rank 0's rollout side finds it unreachable) is waited for until the
launcher has replaced it; then every rank exports the current weights again and rank 0 pushes them
into the new engine before generation resumes (`next_batch`, `push_weights`).

Weight versions are training steps: the engine's initial weights are version 0, the weights after
step s are version s. A file RUN_DIR/control/preempt, checked at each step boundary, makes the
run write a complete checkpoint and exit 0; `--resume` continues from the latest complete one.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles.cluster.environment import set_intra_op_threads
from miles.config import Plan, read_plan
from miles.loop.rollout_side import REPLACED
from miles.loop.state import LoopState, barrier_flag, broadcast, setup_logging
from miles.processes import die_with_parent

if TYPE_CHECKING:
    from miles.eval.modes import Evaluations
    from miles.loop.rollout_side import RolloutSide
    from miles.sample import Sample
    from miles.train.backend import TrainBackend

log = logging.getLogger("miles.loop")


def train_step(
    backend: TrainBackend, samples: list[Sample], side: RolloutSide | None, take_turns: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """One training step (train/* metrics) and its times; with `take_turns` the engines release
    their GPU memory first and resume it after (rank 0, the rank with the rollout side `side`, asks
    them; every rank waits for the release)."""
    start = time.monotonic()
    if take_turns:
        broadcast(side.release_engines() if side is not None else None)
    t_train = time.monotonic()
    # the critic's metrics keep their own family (critic/*); the policy's become train/*
    metrics = {k if k.startswith("critic/") else f"train/{k}": v for k, v in backend.train(samples).items()}
    t_resume = time.monotonic()
    if take_turns and side is not None:
        side.resume_engines()
    times = {"time/train_s": t_resume - t_train}
    if take_turns:
        times.update(
            {"time/engine_release_s": t_train - start, "time/engine_resume_s": time.monotonic() - t_resume}
        )
    return metrics, times


def push_weights(
    state: LoopState, plan: Plan, backend: TrainBackend, side: RolloutSide | None
) -> dict[str, float]:
    """Push the current weights; an engine lost during the push is replaced and pushed to again
    (at most engine.max_restarts + 1 attempts, all ranks together)."""
    for _ in range(plan.engine.max_restarts + 1):
        metrics = state.push_weights(plan, backend, side)
        if not barrier_flag(side is not None and bool(side.lost)):
            return metrics
        if side is not None:
            side.repair()
    raise RuntimeError(f"weight push kept failing after {plan.engine.max_restarts + 1} engine repairs")


def next_batch(state: LoopState, plan: Plan, backend: TrainBackend, side: RolloutSide | None) -> list[Sample]:
    """Rank 0's next batch on every rank; pushes the current weights first whenever rank 0 had to
    replace an engine (its new engine serves the initial weights until then)."""
    while (samples := broadcast(side.batch(state.step) if side is not None else None)) == REPLACED:
        push_weights(state, plan, backend, side)
    return samples


def evaluate_weights(
    plan: Plan, backend: TrainBackend, side: RolloutSide | None, evals: Evaluations | None, step: int
) -> dict[str, float]:
    """Evaluate the weights of `step`: `shared` mode on the rollout engines now (they serve them);
    otherwise every rank exports them as a snapshot, whose evaluation runs on while training goes
    on (miles.eval.modes). Returns what belongs in this step's record."""
    if plan.eval.mode == "shared":
        return side.evaluate(step) if side is not None else {}
    go, metrics = evals.admit(step, step == plan.train.steps) if evals is not None else (False, {})
    if barrier_flag(go):
        buckets = backend.export_weights(plan.weights.bucket_mb << 20)
        if evals is not None:
            evals.submit(step, buckets)
        else:
            for _ in buckets:
                pass
    return metrics


def log_evaluations(state: LoopState, evals: Evaluations | None, step: int, drain: bool = False) -> None:
    """Rank 0: finished dedicated/external evaluations into the records of their steps (`drain`:
    wait for those still running first)."""
    for at, result in (evals.drain(step) if drain else evals.collect(step)) if evals else []:
        state.logger.amend(at, result)


@dataclass
class Run:
    """One trainer rank's parts of the run; `side` and `evals` are rank 0's (None on the others)."""

    plan: Plan
    backend: TrainBackend
    state: LoopState
    side: RolloutSide | None
    evals: Evaluations | None
    take_turns: bool
    """Colocated + sync: rollout and training take turns on the GPUs, the engines stepping aside while
    the trainer trains (unless both fit); colocated + async: both stay resident all the time."""


def one_step(r: Run, step: int) -> bool:
    """Step `step`: batch, train, push, evaluate, record, checkpoint; True when preempted (its
    checkpoint written)."""
    plan, state, side = r.plan, r.state, r.side
    t0 = time.monotonic()
    samples = next_batch(state, plan, r.backend, side)
    t1 = time.monotonic()
    metrics, times = train_step(r.backend, samples, side, r.take_turns)
    state.step, t2 = step, time.monotonic()
    last = step == plan.train.steps
    pushed = step % plan.weights.update_interval == 0 or last
    if pushed:
        metrics.update(push_weights(state, plan, r.backend, side))
    t3 = time.monotonic()
    state.eval_due |= bool(plan.eval.every_steps) and (step % plan.eval.every_steps == 0 or last)
    # shared mode waits for a push: the engines then serve exactly this step's weights
    if state.eval_due and (pushed or plan.eval.mode != "shared"):
        metrics.update(evaluate_weights(plan, r.backend, side, r.evals, step))
        state.eval_due = False
    if side is not None:  # rank 0
        metrics.update(side.metrics(), **state.rollout_metrics(samples))
        turns = times.get("time/engine_release_s", 0.0) + times.get("time/engine_resume_s", 0.0)
        metrics.update(
            times, **{"time/rollout_s": t1 - t0, "time/sync_s": t3 - t2 + turns, "time/step_s": t3 - t0}
        )
        state.log(step, metrics)
        log.info("step %d reward %.3f", step, metrics["rollout/reward_mean"])
        log_evaluations(state, r.evals, step)
    preempt = barrier_flag(side is not None and state.preempt_requested())
    every = plan.train.checkpoint.every_steps
    if preempt or last or (every and step % every == 0):
        state.save(r.backend, side)
    if preempt:
        log.warning("preempted: checkpoint of step %d written, exiting", step)
    return preempt


def run(run_dir: Path, resume: bool) -> int:
    import torch.distributed as dist

    from miles.eval.runner import evaluations
    from miles.train import get_backend

    plan = read_plan(run_dir / "plan.yaml")
    backend = get_backend(plan.train.backend)()
    if plan.train.draft is not None:  # the speculative draft trained beside the policy
        from miles.train.draft_model import DraftTraining

        backend = DraftTraining(backend)
    backend.setup(plan)
    rank0 = dist.get_rank() == 0
    setup_logging(run_dir, dist.get_rank())
    state = LoopState.restore(backend, plan, run_dir, resume, rank0)
    side = state.rollout_side(plan, run_dir) if rank0 else None
    evals = evaluations(plan, run_dir) if rank0 else None
    colocated_sync = plan.launch.layout == "colocated" and plan.rollout.schedule == "sync"
    r = Run(plan, backend, state, side, evals, colocated_sync and plan.engine.release_memory_in_train)
    try:
        if state.step > 0 or plan.train.lora is not None:  # LoRA: the engines need the adapter at step 0
            push_weights(state, plan, backend, side)
        if state.step == 0 and plan.eval.every_steps > 0:
            row = evaluate_weights(plan, backend, side, evals, 0)
            if rank0:
                state.log(0, row)
        for step in range(state.step + 1, plan.train.steps + 1):
            if one_step(r, step):
                return 0
        log_evaluations(state, evals, state.step, drain=True)
        return 0
    finally:
        if evals is not None:
            evals.close()
        state.close(side)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGKILL)  # never outlive the launcher (torchrun, srun) that started us
    faulthandler.register(
        signal.SIGUSR1, all_threads=True
    )  # `kill -USR1 PID`: every thread's stack to the log
    p = argparse.ArgumentParser(prog="python -m miles.loop", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="run directory holding plan.yaml")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    args = p.parse_args(argv)
    print(f"miles.loop: {set_intra_op_threads()}", file=sys.stderr, flush=True)
    run_dir = Path(args.run_dir).resolve()
    if not (run_dir / "plan.yaml").exists():
        print(f"miles.loop: {run_dir / 'plan.yaml'} does not exist; run `miles train` first", file=sys.stderr)
        return 2
    try:
        rc = run(run_dir, args.resume)
    except BaseException:
        # A failed rank must end even when a helper thread is stuck (e.g. in a collective with an
        # engine that died): print the error, flush, and leave without joining threads.
        traceback.print_exc()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)
    # Everything is written and closed: the interpreter's final collection would walk every object
    # torch and transformers made (about a second on a small CPU) before the launcher sees the end.
    gc.freeze()
    return rc
