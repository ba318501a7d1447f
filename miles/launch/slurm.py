"""Slurm job text, rendered by pure functions: a typed JobSpec in, sbatch script text out, no I/O.

A disaggregated run is ONE heterogeneous job: component 0 is the rollout group, component 1 the
actor group (`#SBATCH hetjob` between them), each role started with `srun --het-group=N`. A
colocated run is one homogeneous group running both roles (`srun --overlap`). Sweeps of
homogeneous layouts add `--array=0-N%k`; the array task picks its point's run directory.

Job hygiene: every step runs with `--kill-on-bad-exit=1` (a task that fails ends its step), the
batch shell ends the job as soon as a fatal step ends (a dead rollout step fails the job instead of
leaving the trainer waiting for engines), and the job's end takes every step with it. A step that is
not fatal (the eval group of `eval.mode: dedicated`, component 2) may end first: the batch log says
so and the job goes on without it (the loop counts its evaluations as skipped).

Preemption: `--signal=B:USR2@S` reaches the batch shell S seconds before the time limit; its trap
touches RUN_DIR/control/preempt (the loop checkpoints at the next step boundary and exits 0), waits
for the actor step, then `scontrol requeue`s the job. Every start runs the loop with `--resume`, so
a requeued job continues from its last complete checkpoint by itself.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

RUN_DIR = "{run_dir}"
"""Placeholder in a step's argv or an env value for the run directory (an array task picks its own)."""


@dataclass(frozen=True)
class ComponentSpec:
    """One het-job component (or the only group of a homogeneous job)."""

    role: str
    nodes: int
    ntasks_per_node: int
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    partition: str | None = None
    constraint: str | None = None
    account: str | None = None
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepSpec:
    """One `srun` step: which group it runs on and what it runs."""

    role: str
    het_group: int | None
    argv: tuple[str, ...]
    srun_flags: tuple[str, ...] = ()
    fatal: bool = True
    """Its end ends the job (stopping the last step first). A step that is not fatal (the eval group's
    engines) may end on its own: the batch log says so, the job goes on, and its end stops it."""


@dataclass(frozen=True)
class JobSpec:
    """Everything the batch script says, resolved. `run_dirs` has one entry per array task (or one)."""

    job_name: str
    run_dirs: tuple[str, ...]
    log_dir: str
    time_limit_min: int
    components: tuple[ComponentSpec, ...]
    steps: tuple[StepSpec, ...]
    env: dict[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    requeue_signal_s: int | None = 120
    array_parallelism: int | None = None
    comment: str | None = None

    @property
    def is_array(self) -> bool:
        return len(self.run_dirs) > 1

    @property
    def is_het(self) -> bool:
        return len(self.components) > 1


def _component_lines(c: ComponentSpec) -> list[str]:
    opts = [f"--nodes={c.nodes}", f"--ntasks-per-node={c.ntasks_per_node}"]
    if c.gpus_per_node:
        opts.append(f"--gpus-per-node={c.gpus_per_node}")
    if c.cpus_per_task:
        opts.append(f"--cpus-per-task={c.cpus_per_task}")
    for name, value in (("partition", c.partition), ("constraint", c.constraint), ("account", c.account)):
        if value:
            opts.append(f"--{name}={value}")
    return [f"#SBATCH {o}" for o in (*opts, *c.flags)]


def _header(spec: JobSpec) -> list[str]:
    out_pattern = "%A_%a" if spec.is_array else "%j"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --output={spec.log_dir}/{out_pattern}_0_log.out",
        f"#SBATCH --error={spec.log_dir}/{out_pattern}_0_log.err",
        f"#SBATCH --time={spec.time_limit_min}",
        "#SBATCH --open-mode=append",
    ]
    if spec.comment:
        lines.append(f"#SBATCH --comment={spec.comment}")
    if spec.requeue_signal_s is not None:
        lines += [f"#SBATCH --signal=B:USR2@{spec.requeue_signal_s}", "#SBATCH --requeue"]
    if spec.is_array:
        k = spec.array_parallelism or len(spec.run_dirs)
        lines.append(f"#SBATCH --array=0-{len(spec.run_dirs) - 1}%{k}")
    for i, comp in enumerate(spec.components):
        if i:
            lines.append("#SBATCH hetjob")
        lines += _component_lines(comp)
    return lines


def _run_dir_lines(spec: JobSpec) -> list[str]:
    if not spec.is_array:
        return [f"RUN_DIR={shlex.quote(spec.run_dirs[0])}"]
    quoted = " ".join(shlex.quote(d) for d in spec.run_dirs)
    return [f"RUN_DIRS=({quoted})", 'RUN_DIR="${RUN_DIRS[$SLURM_ARRAY_TASK_ID]}"']


def _pid(step: StepSpec) -> str:
    """The batch-shell variable holding the PID of the step's `srun` (ACTOR_PID, ROLLOUT_PID, ...)."""
    return f"${step.role.upper()}_PID"


TRAP = """\
# USR2 before the time limit: ask the loop for a checkpoint, let the {role} step finish it, requeue.
on_usr2() {{
  echo "miles: USR2 at $(date +%s): checkpoint requested, requeueing job $SLURM_JOB_ID"
  touch "$RUN_DIR/control/preempt"
  wait "{pid}"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}}
trap on_usr2 USR2"""


def _srun(step: StepSpec) -> str:
    words = ["srun", "--kill-on-bad-exit=1", "--export=ALL"]
    if step.het_group is not None:
        words.append(f"--het-group={step.het_group}")
    words += list(step.srun_flags)
    redirect = f'--output="$RUN_DIR/logs/{step.role}-%t.log"'
    return " ".join([*words, redirect, *(_word(a) for a in step.argv)])


def _word(text: str) -> str:
    """Shell-quote `text`, expanding the run-directory placeholder to "$RUN_DIR"."""
    if RUN_DIR not in text:
        return shlex.quote(text)
    return '"' + text.replace(RUN_DIR, "$RUN_DIR").replace('"', '\\"') + '"'


def _tail(role: str, lines: int = 12) -> str:
    """Shell: the last lines of each log of a failed step, so the batch log shows its error."""
    return f'tail -v -n {lines} "$RUN_DIR/logs/{role}"-*.log 2>/dev/null | sed "s/^/  | /"'


def _wait_lines(spec: JobSpec) -> list[str]:
    """Wait for whichever fatal step ends first: the last step's status is the job's; another fatal step
    ending first (the engines are gone) stops the last step and fails the job, which then never hangs.
    The failed step's logs end the batch log (`miles: <role> step exited with N`, then their tails).
    A step that is not fatal ending is reported once and the wait goes on; the job's end stops it."""
    last = spec.steps[-1]
    others = [s for s in spec.steps[:-1] if s.fatal]
    optional = [s for s in spec.steps[:-1] if not s.fatal]
    alive = " && ".join(f'kill -0 "{_pid(s)}" 2>/dev/null' for s in [last, *others])
    lines = [
        "",
        f"# The first step to end decides: the {last.role} step's status is the job's; any other step ending",
        "# first fails the job at once. `wait -n` returns early when a trapped signal arrives.",
    ]
    if not optional:
        lines.append(f"while {alive}; do wait -n; done")
    else:
        lines += [
            f"# Not watched: the {s.role} step (its end is reported, the job goes on)." for s in optional
        ]
        lines += [f"{s.role.upper()}_ENDED=0" for s in optional]
        lines += [f"while {alive}; do", "  wait -n"]
        for s in optional:
            flag = f"{s.role.upper()}_ENDED"
            lines += [
                f'  if [ "${flag}" -eq 0 ] && ! kill -0 "{_pid(s)}" 2>/dev/null; then',
                f"    {flag}=1",
                f'    echo "miles: {s.role} step ended; the job goes on without it"',
                f"    {_tail(s.role)}",
                "  fi",
            ]
        lines.append("done")
    lines += [
        f'if ! kill -0 "{_pid(last)}" 2>/dev/null; then',
        f'  wait "{_pid(last)}"; STATUS=$?',
        f'  echo "miles: {last.role} step exited with $STATUS"',
        f'  [ "$STATUS" -eq 0 ] || {_tail(last.role)}',
    ]
    for step in others:
        lines += [
            f'elif ! kill -0 "{_pid(step)}" 2>/dev/null; then',
            f'  wait "{_pid(step)}"; STATUS=$?',
            f'  echo "miles: {step.role} step exited with $STATUS before the {last.role} step; stopping the job"',
            '  [ "$STATUS" -ne 0 ] || STATUS=1',
            f"  {_tail(step.role)}",
            f'  kill -TERM "{_pid(last)}" 2>/dev/null; wait "{_pid(last)}" 2>/dev/null',
        ]
    lines.append("fi")
    lines += [f'kill -TERM "{_pid(s)}" 2>/dev/null; wait "{_pid(s)}" 2>/dev/null' for s in spec.steps[:-1]]
    return [*lines, 'exit "$STATUS"', ""]


def render_sbatch(spec: JobSpec) -> str:
    """The batch script of `spec` (the exact text handed to sbatch)."""
    assert spec.steps and spec.steps[-1].fatal, "the last step is the one whose exit ends the job"
    last = spec.steps[-1]
    lines = _header(spec)
    lines += ["", "set -uo pipefail", *_run_dir_lines(spec)]
    lines += [f"export {k}={_word(v)}" for k, v in sorted(spec.env.items())]
    lines += list(spec.setup)
    lines += ['mkdir -p "$RUN_DIR/logs" "$RUN_DIR/control"', 'rm -f "$RUN_DIR/control/preempt"']
    lines += ['echo "miles: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} run $RUN_DIR"']
    if spec.requeue_signal_s is not None:
        lines += ["", TRAP.format(role=last.role, pid=_pid(last))]
    lines.append("")
    for step in spec.steps:
        lines += [_srun(step) + " &", f"{step.role.upper()}_PID=$!"]
    return "\n".join(lines + _wait_lines(spec))


def sbatch_command(script_path: str) -> list[str]:
    """The command that submits a rendered script (printed by --dry-run)."""
    return ["sbatch", "--parsable", script_path]
