"""`miles tasks check DIR...`: every task through the episode path twice, with its oracle and with an
agent that does nothing.

The oracle (solution/solve.sh) must score 1 and the do-nothing agent 0: a task whose tests pass
untouched, or whose own solution fails them, cannot teach anything. Both runs are exactly what
training does (a fresh sandbox, the Dockerfile replayed, /tests only at verification), so a task
that passes here runs in training on this host.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from miles.agentic.harbor.episode import Episode, StepUnhealthy, VerifierResult
from miles.agentic.harbor.sandboxes import offline_reason, prepare_image
from miles.agentic.harbor.task import Task, TaskError
from miles.agentic.sandbox.base import SandboxStartError
from miles.agentic.sandbox.bwrap import BwrapSettings
from miles.agentic.sandbox.container import ContainerSandboxConfig


@dataclass
class TaskCheck:
    """The two verdicts of one task."""

    task: str
    oracle: VerifierResult | None
    """None when the task has no solution/solve.sh."""
    nothing: VerifierResult | None
    error: str = ""
    """Why the task could not run here (unsupported on this backend, malformed), or ""."""
    offline: str = ""
    """Why its episodes ran without the network its [environment] allow_internet (Harbor's default)
    asks for (miles/agentic/harbor/sandboxes.py's offline_reason), or ""."""
    entrypoint: str = ""
    """Where the Dockerfile's ENTRYPOINT is, which episodes do not run (each command runs on its own), or ""."""

    @property
    def passed(self) -> bool:
        if self.error or self.nothing is None:
            return False
        oracle_ok = self.oracle is None or self.oracle.reward == 1.0
        return oracle_ok and self.nothing.reward == 0.0


async def check_task(
    task: Task,
    settings: BwrapSettings | None = None,
    backend: ContainerSandboxConfig | None = None,
    internet: str | None = None,
) -> TaskCheck:
    offline = offline_reason(task, internet, backend)
    entry = next((n.split(": ")[0] for n in task.notes if ": ENTRYPOINT " in n), "")
    try:
        await prepare_image(task, backend)
        if task.task_steps:
            oracle, nothing = await _check_steps(task, settings, backend, internet)
            return TaskCheck(task.name, oracle, nothing, offline=offline, entrypoint=entry)
        oracle = None
        if task.solution_dir is not None:
            async with Episode(task, settings, backend=backend, internet=internet) as ep:
                await ep.run_solution()
                oracle = await ep.verify()
        async with Episode(task, settings, backend=backend, internet=internet) as ep:
            nothing = await ep.verify()
        return TaskCheck(task.name, oracle, nothing, offline=offline, entrypoint=entry)
    except TaskError as e:
        return TaskCheck(task.name, None, None, str(e))
    except SandboxStartError as e:
        return TaskCheck(task.name, None, None, f"no sandbox: {e}")


async def run_steps(task: Task, ep: Episode, oracle: bool) -> VerifierResult:
    """A multi-step task in one episode, step by step (its workdir, then the step's solution when
    `oracle`, then its verifier), stopping after a step below its min_reward; one result whose reward
    is the task's roll-up (multi_step_reward_strategy) and whose output lists each step's."""
    rewards, lines, status, seconds = [], [], "ok", 0.0
    for step in task.task_steps:
        try:
            await ep.begin_step(step)
        except StepUnhealthy as e:
            rewards.append(0.0)
            lines.append(f"{e}; the episode ends here")
            break
        if oracle and step.part("solution") is not None:
            await ep.run_solution(step)
        res = await ep.verify(step)
        seconds += res.seconds
        rewards.append(res.reward if res.reward is not None else 0.0)
        lines.append(
            f"step {step.name}: {_cell(res)}" + (f"\n{res.output.strip()}" if res.reward != 1.0 else "")
        )
        if res.reward is None:
            status = res.status
        if step.config.min_reward is not None and rewards[-1] < step.config.min_reward:
            lines.append(
                f"stopped after step {step.name}: reward below its min_reward {step.config.min_reward:g}"
            )
            break
    return VerifierResult(task.reward(rewards), status, seconds, "\n".join(lines))


async def _check_steps(
    task: Task, settings, backend, internet: str | None
) -> tuple[VerifierResult | None, VerifierResult]:
    """(oracle, do-nothing) of a multi-step task: the oracle runs every step's solution (None when no
    step has one)."""
    oracle = None
    if any(s.part("solution") is not None for s in task.task_steps):
        async with Episode(task, settings, backend=backend, internet=internet) as ep:
            oracle = await run_steps(task, ep, oracle=True)
    async with Episode(task, settings, backend=backend, internet=internet) as ep:
        nothing = await run_steps(task, ep, oracle=False)
    return oracle, nothing


async def check_tasks(
    tasks: list[Task],
    jobs: int = 2,
    settings: BwrapSettings | None = None,
    backend: ContainerSandboxConfig | None = None,
    internet: str | None = None,
) -> list[TaskCheck]:
    gate = asyncio.Semaphore(jobs)

    async def one(t: Task) -> TaskCheck:
        async with gate:
            return await check_task(t, settings, backend, internet)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def _cell(r: VerifierResult | None) -> str:
    if r is None:
        return "-"
    return f"{r.reward:g}" if r.reward is not None else f"masked ({r.status})"


_AS_ROOT = re.compile(r"are you root\?|dpkg.*Permission denied|apt.*\(13: Permission denied\)")
"""Verifier output of a package install that needed root."""
TAIL_LINES = 6
"""Lines of the verifier's output shown under a FAILED task."""


def _why(r: TaskCheck) -> str:
    """Why a task that ran failed, with the tail of the failing verifier's output (indented lines)."""
    if r.oracle is not None and r.oracle.reward != 1.0:
        which, res = "the oracle (solution/solve.sh) scored", r.oracle
    else:
        which, res = "the do-nothing agent scored", r.nothing
    cell = _cell(res)
    tail = [line for line in (res.output or "").strip().splitlines() if line.strip()][-TAIL_LINES:]
    shown = "".join(f"\n      | {line[:200]}" for line in tail)
    why = f"{which} {cell}; " + (f"verifier output ends:{shown}" if tail else "the verifier printed nothing")
    if _AS_ROOT.search(res.output or ""):
        why += (
            "\n      (the verifier or solution installs packages as root (apt-get, dpkg); episodes run "
            "as an unprivileged user: what it installs belongs in the task's image)"
        )
    if r.entrypoint:
        why += (
            f"\n      ({r.entrypoint}: the image's ENTRYPOINT is not run; what it starts in the background "
            "(a server, a daemon) is missing from episodes, whose commands each run on their own)"
        )
    if r.offline:
        why += (
            "\n      (the task sets [environment] allow_internet (Harbor's default) and its episodes ran "
            f"without network: {r.offline}; a verifier or solution that downloads (apt-get, pip, curl) "
            "needs the network, or what it fetches baked into the task's image)"
        )
    return why


def report(results: list[TaskCheck]) -> tuple[str, bool]:
    """The table printed by `miles tasks check` and whether every task passed."""
    width = max([len(r.task) for r in results] + [4])
    lines = [f"{'task':{width}s}  {'oracle':>18s}  {'do-nothing':>18s}  verdict"]
    for r in results:
        verdict = "ok" if r.passed else ("ERROR: " + r.error if r.error else "FAILED: " + _why(r))
        if r.passed and r.oracle is None:
            verdict = "ok (no solution/solve.sh: oracle not run)"
        if r.oracle is not None and r.oracle.rewards:
            verdict += (
                " (oracle's rewards: " + ", ".join(f"{k}={v:g}" for k, v in r.oracle.rewards.items()) + ")"
            )
        lines.append(f"{r.task:{width}s}  {_cell(r.oracle):>18s}  {_cell(r.nothing):>18s}  {verdict}")
    ok = all(r.passed for r in results)
    lines.append(f"{sum(r.passed for r in results)}/{len(results)} tasks passed")
    return "\n".join(lines), ok
