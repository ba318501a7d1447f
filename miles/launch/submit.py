"""`miles submit` and `miles sweep`: recipe + profile -> checked plan -> run dir -> Slurm job(s).

Order: pick the profile (flag, else the recipe's launch.profile), resolve the recipe over the
profile's defaults, prepare the run's inputs on this host (miles.launch.prepare: the task and
reward are checked, a missing tiny model is created atomically, so the job only reads them; a
dry run creates nothing), check the layout against the profile, write plan.yaml + launch.json +
submission.sh into the run directory, then (unless --dry-run) submit through submitit and record
the job id in RUN_DIR/job.json. A sweep over a homogeneous layout is one job array; over a
heterogeneous layout one het job per point (Slurm forbids arrays of het jobs), all sharing a tag
recorded in <runs_root>/sweeps/<tag>.json.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.cluster.rendezvous import write_atomic
from miles.config import ConfigError, Plan, resolve, write_plan
from miles.config.loading import apply_overrides, read_yaml
from miles.config.profile import Profile, load_profile, profile_defaults
from miles.launch.prepare import prepare_inputs
from miles.launch.rundir import earlier_run
from miles.launch.slurm import render_sbatch, sbatch_command
from miles.launch.spec import build_job, check
from miles.serving import make_run_keys


@dataclass(frozen=True)
class Submission:
    """What one submission produced: the script, where it lies, and the job ids (none on dry-run)."""

    run_dirs: list[str]
    script_path: str
    command: list[str]
    job_ids: list[str]
    more_commands: list[list[str]] = field(default_factory=list)
    """The sbatch lines of the other points of a sweep of het jobs (one job per point)."""


def load_plan(
    recipe: str | dict[str, Any], profile: str | None, overrides: list[str]
) -> tuple[Plan, Profile]:
    """Resolve a recipe for a profile: profile defaults < recipe < overrides (launch.profile follows the flag)."""
    data = read_yaml(recipe) if isinstance(recipe, str) else dict(recipe)
    name = profile or str(apply_overrides(data, overrides).get("launch", {}).get("profile", "local"))
    prof = load_profile(name)
    extra = [f"launch.profile={prof.name}"] if profile else []
    plan = resolve(data, [*overrides, *extra], profile_defaults=profile_defaults(prof))
    return plan, prof


def _prepare_run(plan: Plan, profile: Profile, dry_run: bool) -> tuple[Path, Path]:
    """Inputs first (a dry run only checks them), then the run directory with plan and launch facts;
    (the run directory, where its files were written). A dry run into the directory of an earlier run
    writes beside it, in `<run>.dry-run/`, and leaves that run's files as they are."""
    prepare_inputs(plan, local=not profile.container.enabled, create=not dry_run)
    run_dir = out = Path(plan.run_dir)
    if dry_run and earlier_run(run_dir):
        out = run_dir.with_name(run_dir.name + ".dry-run")
        print(f"miles: {run_dir} holds an earlier run; the dry run writes to {out} instead", file=sys.stderr)
    (out / "logs" / "slurm").mkdir(parents=True, exist_ok=True)
    write_plan(plan, out / "plan.yaml")
    write_atomic(out / "launch.json", check(plan, profile), indent=1)
    if not dry_run:  # the job's servers take these keys, its clients send them (miles.serving)
        make_run_keys(run_dir)
    return run_dir, out


def _submit(script: str, script_path: Path, log_dir: str, array_size: int | None) -> list[str]:
    from miles.launch.jobs import FailedSubmissionError, ScriptExecutor

    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise ConfigError("sbatch/srun not found: submit from a Slurm login node, or pass --dry-run")
    try:
        jobs = ScriptExecutor(log_dir, script).submit_script(array_size)
    except FailedSubmissionError as e:
        raise ConfigError(f"sbatch refused {script_path}: {e}") from None
    return [j.job_id for j in jobs]


def submit(
    recipe: str | dict[str, Any], profile: str | None, overrides: list[str], *, dry_run: bool = False
) -> Submission:
    """Render (and unless dry_run, submit) one job for the recipe; returns paths and the job id."""
    plan, prof = load_plan(recipe, profile, overrides)
    run_dir, out = _prepare_run(plan, prof, dry_run)
    log_dir = str(run_dir / "logs" / "slurm")
    script = render_sbatch(build_job(plan, prof, [str(run_dir)], log_dir=log_dir))
    script_path = out / "submission.sh"
    script_path.write_text(script)
    command = sbatch_command(str(script_path))
    if dry_run:
        return Submission([str(run_dir)], str(script_path), command, [])
    (job_id,) = _submit(script, script_path, log_dir, None)
    record = {
        "job_id": job_id,
        "log_dir": log_dir,
        "submitted_at": time.time(),
        "sweep": plan.launch.sweep_tag,
    }
    write_atomic(run_dir / "job.json", record, indent=1)
    return Submission([str(run_dir)], str(script_path), command, [job_id])


def grid_points(grid: list[str]) -> list[list[str]]:
    """`["a.b=1,2", "c=x,y"]` -> the override lists of the cartesian product, in order."""
    axes = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values:
            raise ConfigError(f"--grid {item!r} must look like section.key=v1,v2")
        axes.append([f"{key.strip()}={v}" for v in values.split(",")])
    return [list(p) for p in itertools.product(*axes)]


def sweep(
    recipe: str,
    profile: str | None,
    overrides: list[str],
    grid: list[str],
    *,
    tag: str | None = None,
    dry_run: bool = False,
) -> Submission:
    """One job array (homogeneous layout) or one het job per point (disaggregated), sharing `tag`."""
    tag = tag or time.strftime("%Y%m%d-%H%M%S")
    points = grid_points(grid)
    base, _ = load_plan(recipe, profile, overrides)
    per_point = [
        [*overrides, *point, f"run.name={base.run.name}-{tag}-{i}", f"launch.sweep_tag={tag}"]
        for i, point in enumerate(points)
    ]
    sweep_dir = Path(base.run.runs_root) / "sweeps" / tag
    if base.launch.layout == "colocated":
        result = _sweep_array([load_plan(recipe, profile, o) for o in per_point], sweep_dir, dry_run)
    else:
        subs = [submit(recipe, profile, o, dry_run=dry_run) for o in per_point]
        job_ids = [j for s in subs for j in s.job_ids]
        result = Submission(
            [s.run_dirs[0] for s in subs],
            subs[0].script_path,
            subs[0].command,
            job_ids,
            [s.command for s in subs[1:]],
        )
    index = [{"run_dir": d, "overrides": p} for d, p in zip(result.run_dirs, points, strict=True)]
    for point, job_id in zip(index, result.job_ids, strict=False):
        point["job_id"] = job_id
    write_atomic(sweep_dir.parent / f"{tag}.json", {"tag": tag, "points": index}, indent=1)
    return result


def _sweep_array(plans: list[tuple[Plan, Profile]], sweep_dir: Path, dry_run: bool) -> Submission:
    run_dirs = [str(_prepare_run(plan, prof, dry_run)[0]) for plan, prof in plans]
    plan, prof = plans[0]
    log_dir = str(sweep_dir / "slurm")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    script = render_sbatch(build_job(plan, prof, run_dirs, log_dir=log_dir))
    script_path = sweep_dir / "submission.sh"
    script_path.write_text(script)
    command = sbatch_command(str(script_path))
    if dry_run:
        return Submission(run_dirs, str(script_path), command, [])
    job_ids = _submit(script, script_path, log_dir, len(run_dirs))
    for run_dir, job_id in zip(run_dirs, job_ids, strict=True):
        (Path(run_dir) / "submission.sh").write_text(script)
        record = {"job_id": job_id, "log_dir": log_dir, "sweep": plan.launch.sweep_tag}
        write_atomic(Path(run_dir) / "job.json", record, indent=1)
    return Submission(run_dirs, str(script_path), command, job_ids)
