"""What a run needs on disk before any of its processes start, prepared once and atomically.

`miles train` calls this on its host; `miles submit` and `miles sweep` call it on the submit host
before `sbatch`, so a job (every array task, every requeue) only ever reads a complete model:

- what the loop builds from the plan (the rollout task, the reward, episode plug-ins, the evaluation's
  datasets or `eval.external_fn`: miles.loop.inputs) is built here, so a bad task option, dataset file
  or reward path is a ConfigError now, not a traceback in a job's log;
- `model.path` (weights, config and tokenizer) must exist; with `model.init_tiny_if_missing` a tiny
  random model is created there; with `model.base_recipe` (local runs) that recipe is trained and
  its last checkpoint exported there. It is written into a temporary sibling directory and renamed into
  place (a reader sees no model or a whole one), under a lock file beside it so that concurrent
  submissions create it once: the others wait for the lock and then find it.

Imports no torch (the model writer imports it only when a model is created).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from miles.config import ConfigError, Plan
from miles.config.model import TinyModelConfig
from miles.loop.inputs import check_inputs

log = logging.getLogger("miles.launch")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if absent) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_model(plan: Plan, *, required: bool = True, train_base: bool = False) -> Path:
    """Make sure `model.path` exists, creating the tiny model when `model.init_tiny_if_missing` is set,
    or with `train_base` (a local run) training `model.base_recipe` and exporting it there.

    A missing model without either is a ConfigError when `required` (else only logged: the path may
    exist only where the job runs, e.g. inside a container image).
    """
    path = Path(plan.model.path)
    if path.exists():
        return path
    if plan.model.base_recipe is not None:
        if not train_base:
            message = (
                f"model.path={str(path)!r} does not exist: make it first with `miles train "
                f"{plan.model.base_recipe}` and `miles export` (model.base_recipe is trained only by local runs)"
            )
            if required:
                raise ConfigError(message)
            log.warning("%s (not checked further: the job may see another filesystem)", message)
            return path
        with _locked(path.parent / f".{path.name}.lock"):
            if not path.exists():
                _train_base(path, plan.model.base_recipe, plan.model.base_overrides, plan.run.runs_root)
        return path
    if not plan.model.init_tiny_if_missing:
        message = f"model.path={str(path)!r} does not exist; set model.init_tiny_if_missing=true or fix it"
        if required:
            raise ConfigError(message)
        log.warning("%s (not checked further: the job may see another filesystem)", message)
        return path
    with _locked(path.parent / f".{path.name}.lock"):
        if path.exists():  # another submission made it while we waited for the lock
            return path
        _create_tiny(path, plan.model.tiny, plan.run.seed)
    return path


def _create_tiny(path: Path, tiny: TinyModelConfig, seed: int) -> None:
    """init_tiny (`tiny`: model.tiny) into a temporary sibling, then one rename: readers never see a
    partial model."""
    from miles.models.tiny import init_tiny

    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    what = f"base model ({tiny.pretrain_steps} pretraining steps)" if tiny.pretrain_steps else "random model"
    print(f"miles: creating a tiny {what} at {path} ({tiny.arch})", file=sys.stderr)
    start = last = time.monotonic()

    def report(step: int, loss: float) -> None:  # the first step, then every 10 s, and the last
        nonlocal last
        now = time.monotonic()
        if step not in (1, tiny.pretrain_steps) and now - last < 10.0:
            return
        last, left = now, (tiny.pretrain_steps - step) * (now - start) / step
        print(f"miles: pretraining {step}/{tiny.pretrain_steps} steps, loss {loss:.3f}, ~{left:.0f} s left",
              file=sys.stderr, flush=True)  # fmt: skip

    try:
        from miles.quant.invariant import one_torch_thread  # one thread: tiny GEMMs (bench/RESULTS.md)

        with one_torch_thread():
            init_tiny(
                tmp,
                arch=tiny.arch,
                seed=seed,
                vocab_size=tiny.vocab_size,
                corpus=tiny.corpus,
                pretrain_steps=tiny.pretrain_steps,
                report=report,
                mtp=tiny.mtp,
                **tiny.sizes,
            )
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _train_base(path: Path, recipe: str, overrides: list[str], runs_root: str) -> None:
    """`miles train RECIPE --set OVERRIDES` (a child process, in `runs_root`), then its last checkpoint
    exported into a temporary sibling of `path` and renamed into place."""
    from miles.config import resolve
    from miles.export import export_run

    overrides = [*overrides, f"run.runs_root={runs_root}"]
    base = resolve(recipe, overrides)
    print(f"miles: training the base model {path} with {recipe} (model.base_recipe)", file=sys.stderr)
    sets = [x for o in overrides for x in ("--set", o)]
    cmd = [sys.executable, "-m", "miles.cli", "train", recipe, *sets, "--overwrite"]
    if subprocess.run(cmd).returncode != 0:
        raise ConfigError(f"model.base_recipe {recipe}: its run failed (see {base.run_dir}/logs)")
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_run(base.run_dir, tmp)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_inputs(plan: Plan, *, local: bool = True, create: bool = True) -> Path:
    """Everything above for one plan; returns the model path. `local=False` (a submission whose steps
    run in a container) skips what needs the job's own software and filesystem to be checked;
    `create=False` (a dry run) checks without writing anything."""
    if local:
        check_inputs(plan)
    path = ensure_model(plan, required=local) if create else Path(plan.model.path)
    if local:
        check_teacher_model(plan)
    return path


def check_teacher_model(plan: Plan) -> None:
    """train.distill.teacher_model exists and tokenises as model.path does (ConfigError otherwise)."""
    d = plan.train.distill
    if d is None or not d.teacher_model:
        return
    if not (Path(d.teacher_model) / "config.json").exists():
        raise ConfigError(
            f"train.distill.teacher_model={d.teacher_model!r} is not a model directory (no config.json)"
        )
    if not Path(plan.model.path).exists():
        return  # a dry run before the student exists: checked again by the run
    from miles.rollout.teacher import tokenizer_difference

    problem = tokenizer_difference(plan.model.path, d.teacher_model)
    if problem:
        raise ConfigError(
            f"train.distill.teacher_model: {problem}; the teacher must use the student's tokenizer"
        )
