"""`miles eval RUN_DIR --step N [--submit]`: evaluate one step's snapshot of a run, here or as a Slurm job.

Without --submit it runs in this process (miles.eval.runner.evaluate_snapshot): the run's eval mode
(`external` calls eval.external_fn, `dedicated` starts an eval engine here; a `shared` run's
snapshots are evaluated as `dedicated`), or `--fn module:function` for another external function.
The result goes to RUN_DIR/eval/step_N/manual.json and the console (the run's metrics.jsonl is
left to the run's own loop, which may still be writing it).

With --submit the same command becomes a Slurm job of one group and one step, rendered by
miles.launch.slurm from a JobSpec with the profile's partition, CPUs, GPUs, environment, set-up
and container, and submitted through the same layer as `miles submit`. The job has a directory of
its own, RUN_DIR/eval/step_N/job/ (submission.sh, job.json, logs/), so `miles status` and
`miles logs` work on it. Imports no torch (login nodes submit).
"""

from __future__ import annotations

import argparse
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
    """Render (and unless dry_run, submit) the evaluation job of one complete snapshot, or of a
    checkpointed step (the job exports its weights first)."""
    from miles.eval.snapshot import find_snapshot
    from miles.launch.jobs import FailedSubmissionError, ScriptExecutor
    from miles.train.checkpoint import complete_steps

    run_dir = Path(run_dir).resolve()
    plan = read_plan(run_dir / "plan.yaml")
    if step not in complete_steps(run_dir):
        find_snapshot(run_dir, step)
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


def cmd_eval(args: argparse.Namespace) -> int:
    if not args.submit:
        from miles.eval.runner import snapshot_main

        return snapshot_main(args)
    try:
        sub = submit_eval(
            args.run_dir, args.step, profile=args.profile, mode=args.mode, fn=args.fn, dry_run=args.dry_run
        )
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if sub.job_id is None:
        print(f"wrote {sub.script_path}")
        print(" ".join(sub.command))
    else:
        print(f"submitted job {sub.job_id}: evaluation of step {args.step}, in {sub.job_dir}")
    return 0


def add_eval_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate the snapshot of one step of a run (here, or --submit to Slurm)")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--step", type=int, required=True, help="the step whose snapshot to evaluate")
    p.add_argument("--mode", choices=["dedicated", "external"], help="default: the run's eval.mode")
    p.add_argument("--fn", help="an external eval function (module:function); implies --mode external")
    p.add_argument("--out", help="result JSON (default RUN_DIR/eval/step_N/manual.json)")
    p.add_argument("--submit", action="store_true", help="run it as a Slurm job of its own")
    p.add_argument("--profile", help="hardware profile of the job (default: the run's launch.profile)")
    p.add_argument("--dry-run", action="store_true", help="with --submit: write the script, do not submit")
    p.set_defaults(func=cmd_eval)
