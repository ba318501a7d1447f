"""`miles eval RUN_DIR --step N --submit`: the evaluation of one step of a run as a Slurm job.

The by-hand evaluation (`python -m miles.eval.runner snapshot`) becomes a Slurm job of one group and
one step, rendered by miles.launch.slurm from a JobSpec with the profile's partition, CPUs, GPUs,
environment, set-up and container, and submitted through the same layer as `miles submit`. The job
has a directory of its own, RUN_DIR/eval/step_N/job/ (submission.sh, job.json, logs/), so `miles
status` and `miles logs` work on it. Imports no torch (login nodes submit).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from miles.config import ConfigError, Plan, read_plan
from miles.config.profile import Profile, load_profile
from miles.launch.slurm import ComponentSpec, JobSpec, StepSpec, render_sbatch, sbatch_command
from miles.launch.spec import container_flags, container_image

ENGINE_START_MIN = 15
"""Minutes allowed for the job's start-up (container, imports, an eval engine) besides eval.timeout_s."""


@dataclass(frozen=True)
class EvalSubmission:
    job_dir: str
    script_path: str
    command: list[str]
    job_id: str | None


def job_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "eval" / f"step_{step}" / "job"


def eval_argv(python: str, run_dir: str, step: int, mode: str | None, fn: str | None) -> tuple[str, ...]:
    """The job-side command: the by-hand evaluation of one snapshot."""
    argv = (python, "-m", "miles.eval.runner", "snapshot", "--run-dir", run_dir, "--step", str(step))
    return argv + (("--mode", mode) if mode else ()) + (("--fn", fn) if fn else ())


def build_eval_job(
    plan: Plan, profile: Profile, run_dir: str, step: int, *, mode: str | None = None, fn: str | None = None,
    python: str | None = None,
) -> JobSpec:  # fmt: skip
    """The JobSpec of one snapshot evaluation: one node of the profile, one task, all its GPUs and CPUs."""
    image = container_image(plan, profile)
    python = python or ("python" if image else sys.executable)
    env = {"PYTHONUNBUFFERED": "1", **profile.env}
    flags = (*container_flags(plan, profile, image, env), *profile.srun_flags)
    component = ComponentSpec(
        "eval",
        1,
        1,
        profile.gpus_per_node,
        cpus_per_task=profile.cpus_per_node,
        partition=plan.launch.partition or profile.partition,
        constraint=profile.constraint,
        account=profile.account,
        flags=tuple(profile.sbatch_flags),
    )
    # the one step is the job's last: its exit ends the job
    step_spec = StepSpec("eval", None, eval_argv(python, run_dir, step, mode, fn), flags)
    return JobSpec(
        job_name=f"miles-eval-{plan.run.name}-step{step}",
        run_dirs=(str(job_dir(run_dir, step)),),
        log_dir=str(job_dir(run_dir, step) / "logs" / "slurm"),
        time_limit_min=ENGINE_START_MIN + math.ceil(plan.eval.timeout_s / 60),
        components=(component,),
        steps=(step_spec,),
        env=env,
        setup=tuple(profile.setup),
        requeue_signal_s=None,
    )


def submit_eval(
    run_dir: str | Path, step: int, *, profile: str | None = None, mode: str | None = None,
    fn: str | None = None, dry_run: bool = False,
) -> EvalSubmission:  # fmt: skip
    """Render (and unless dry_run, submit) the evaluation job of one step of a run: a step with a
    complete eval snapshot, or a checkpointed one (the job exports its weights first); the caller
    has checked that the step is one of them (`miles eval`)."""
    from miles.launch.jobs import FailedSubmissionError, ScriptExecutor

    run_dir = Path(run_dir).resolve()
    plan = read_plan(run_dir / "plan.yaml")
    if (fn is None and (mode or plan.eval.mode) == "external") and not plan.eval.external_fn:
        raise ConfigError(f"{run_dir}: eval.external_fn is not set in its plan; pass --fn module:function")
    prof = load_profile(profile or plan.launch.profile)
    spec = build_eval_job(plan, prof, str(run_dir), step, mode=mode, fn=fn)
    folder = Path(spec.run_dirs[0])
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
    script_path = folder / "submission.sh"
    script = render_sbatch(spec)
    script_path.write_text(script)
    command = sbatch_command(str(script_path))
    if dry_run:
        return EvalSubmission(str(folder), str(script_path), command, None)
    try:
        (job,) = ScriptExecutor(spec.log_dir, script).submit_script(None)
    except FailedSubmissionError as e:
        raise ConfigError(f"sbatch refused {script_path}: {e}") from None
    record = {"job_id": job.job_id, "log_dir": spec.log_dir, "submitted_at": time.time(), "step": step}
    (folder / "job.json").write_text(json.dumps(record, indent=1))
    return EvalSubmission(str(folder), str(script_path), command, job.job_id)
