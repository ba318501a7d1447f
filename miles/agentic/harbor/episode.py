"""One Harbor task in a fresh sandbox: the task's files at /app, the agent's tools, the verifier.

Local backend: a bubblewrap sandbox per episode (miles/agentic/sandbox/bwrap.py) with the host's
toolchain read-only and the episode's own directories at `/app` (the working directory), `/tests`,
`/logs` and `/solution`; nothing is shared between episodes and nothing outlives one. The task's
environment/Dockerfile is replayed instead of built: WORKDIR (under /app), COPY/ADD of the build
context's files, ENV, and RUN commands run in the sandbox without network. A RUN that fails (the
image would have installed what the host lacks) refuses the task with TaskUnsupported naming the line;
so does a task that has only a `docker_image`. Container backends (apptainer / enroot) run every
command in the task's image itself with the same directories bound in, and replay the Dockerfile's
steps after FROM inside it (miles/agentic/harbor/sandboxes.py).

Verification, as Harbor defines it: /tests and /logs are emptied (nothing the agent planted there
counts), tests/ is copied to /tests, `bash /tests/test.sh` runs under [verifier] timeout_sec with
[verifier] env, and the reward is read from /logs/verifier/reward.txt (a number) or reward.json: its
"reward" when it has one, else the mean of its named rewards (Harbor's several reward dimensions, e.g.
{"correctness": 1, "performance": 0}), each kept in the result's `rewards`. A verifier that times out, crashes without a reward or writes no parsable reward gives
`reward None`: the sample is masked, not scored 0, and the status says why.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from miles.agentic.harbor.build import SEED
from miles.agentic.harbor.files import read_sandbox_file, task_files
from miles.agentic.harbor.sandboxes import APP, episode_settings, make_sandbox
from miles.agentic.harbor.task import Task, TaskError, TaskStep
from miles.agentic.sandbox.base import ExecResult, Sandbox
from miles.agentic.sandbox.bwrap import BwrapSettings
from miles.agentic.sandbox.container import ContainerSandbox, ContainerSandboxConfig

OUTPUT_LIMIT = 8192
"""Characters of a tool's output shown to the model (the rest is cut, and the cut is said)."""


class TaskUnsupported(TaskError):
    """The task cannot run on this backend (its image needs what the host lacks)."""


@dataclass
class VerifierResult:
    """What verification gave."""

    reward: float | None
    """The task's reward, or None when the verifier failed (the sample is masked)."""
    status: str
    """`ok`, `timeout`, `crashed` (exited non-zero without a reward), `no_reward` or `bad_reward`."""
    seconds: float
    output: str
    rewards: dict[str, float] | None = None
    """reward.json's named rewards, when it gave several."""


class StepUnhealthy(TaskError):
    """A step's [steps.healthcheck] never passed: the step scores 0 and the episode ends there."""


def truncate(text: str, limit: int = OUTPUT_LIMIT) -> str:
    """`text` cut to `limit` characters (head and tail kept), saying how much was cut."""
    if len(text) <= limit:
        return text
    head, tail = text[: limit // 2], text[-limit // 2 :]
    return f"{head}\n[... {len(text) - len(head) - len(tail)} characters cut ...]\n{tail}"


class Episode:
    """One task in its own sandbox (async context manager): `bash`, `read_file`, `write_file`,
    `str_replace` for the agent, `run_solution` for the oracle, `verify` at the end. The sandbox is
    made here from `settings` and `backend` (miles/agentic/harbor/sandboxes.py), or handed in by a
    pool (`sandbox`, made with `episode_settings(task)`), already created or not."""

    def __init__(
        self,
        task: Task,
        settings: BwrapSettings | None = None,
        output_limit: int = OUTPUT_LIMIT,
        backend: ContainerSandboxConfig | None = None,
        sandbox: Sandbox | None = None,
        internet: str | None = None,
    ) -> None:
        self.task = task
        self.settings = episode_settings(task, settings, internet)
        self.sandbox = (
            sandbox if sandbox is not None else make_sandbox(task, self.settings, backend, internet)
        )
        self.in_image = isinstance(self.sandbox, ContainerSandbox)
        """Commands run in the task's own image (a container backend)."""
        self.built = self.in_image and Path(self.sandbox.cfg.image).name.startswith("miles-task_")  # type: ignore[attr-defined]
        """The image `miles tasks build` made: its RUN and COPY steps are in it, not replayed."""
        self.env: dict[str, str] = dict(task.config.environment.env)
        self.cwd = APP
        self.output_limit = output_limit

    async def __aenter__(self) -> Episode:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sandbox.close()

    async def start(self) -> None:
        if not self.in_image and not self.task.steps and self.task.config.environment.docker_image:
            raise TaskUnsupported(
                f"{self.task.path}: only [environment] docker_image={self.task.base_image!r} describes the "
                "environment; the local backend needs environment/Dockerfile (or run it with a container backend)"
            )
        if self.sandbox.path is None:  # type: ignore[attr-defined]  (a pool's sandbox comes created)
            await self.sandbox.create()
        try:
            await self._replay()
        except BaseException:
            await self.sandbox.close()
            raise

    async def _replay(self) -> None:
        dockerfile = self.task.environment_dir / "Dockerfile"
        if self.built:  # the build's /app into the episode's own
            await self._exec(f"if [ -d {SEED} ]; then cp -a {SEED}/. {APP}/; fi", 600.0)
        for step in self.task.steps:
            if self.built and step.kind in ("run", "copy"):
                continue
            where = f"{dockerfile}:{step.line}"
            if step.kind == "workdir":
                self.cwd = self._under_app(step.args[0], where)
                await self.sandbox.make_dir(self.cwd)
            elif step.kind == "env":
                self.env[step.args[0]] = step.args[1]
            elif step.kind == "copy":
                *sources, dest = step.args
                for src in sources:
                    await self._copy_in(self.task.environment_dir, src, dest, where)
            elif step.kind == "run":
                timeout = self.task.config.environment.build_timeout_sec
                res = await self._exec(step.args[0], timeout)
                if not res.ok:
                    fix = (
                        "episodes replay the Dockerfile without network: build the task's image first "
                        "(miles tasks build TASK --image-dir DIR), which episodes in DIR then start from"
                        if self.in_image
                        else f"the task's image ({self.task.base_image}) provides what this host's toolchain "
                        "lacks: build it (miles tasks build TASK --image-dir DIR) and run the task in it "
                        "(--runtime apptainer --image-dir DIR)"
                    )
                    raise TaskUnsupported(
                        f"{where}: RUN {step.args[0]!r} failed here (exit {res.returncode}"
                        f"{', ' + res.killed_reason if res.killed_reason else ''}): "
                        f"{(res.stderr or res.stdout).strip()[-300:]!r}; {fix}"
                    )

    def _under_app(self, path: str, where: str) -> str:
        absolute = path if path.startswith("/") else f"{self.cwd}/{path}"
        norm = str(Path(absolute))
        if norm != APP and not norm.startswith(APP + "/"):
            raise TaskUnsupported(
                f"{where}: {path!r} is outside /app, the only directory of the image an episode writes to"
            )
        return norm

    async def _copy_in(self, context: Path, src: str, dest: str, where: str) -> None:
        source = (context / src).resolve()
        if context.resolve() not in [source, *source.parents] or not source.exists():
            raise TaskError(f"{where}: COPY source {src!r} is not a file or directory of {context}")
        target = self._under_app(dest, where)
        files = task_files(self.task.path, context / src)
        if source.is_dir():
            for f in files:
                await self.sandbox.write_file(f"{target}/{f.relative_to(context / src)}", f.read_bytes())
        else:
            into_dir = dest.endswith("/") or (self.sandbox.path / target.lstrip("/")).is_dir()  # type: ignore[operator]
            await self.sandbox.write_file(
                f"{target}/{source.name}" if into_dir else target, source.read_bytes()
            )

    async def _exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None) -> ExecResult:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**self.env, **(env or {})}.items())
        prefix = f"export {exports}; " if exports else ""
        return await self.sandbox.exec(
            ["bash", "-c", f"{prefix}cd {shlex.quote(self.cwd)} && {command}"], timeout_s
        )

    # ---- the agent's tools -------------------------------------------------------------------------

    async def bash(self, command: str, timeout_s: float = 30.0) -> str:
        """Run a shell command in /app; its output (stdout then stderr, cut to the limit) and exit code."""
        res = await self._exec(command, timeout_s)
        out = res.stdout + (("\n" if res.stdout else "") + res.stderr if res.stderr else "")
        tail = f"[exit code {res.returncode}]"
        if res.killed_reason:
            tail = f"[stopped: {res.killed_reason}" + (f" after {timeout_s:g} s]" if res.timed_out else "]")
        if "fork" in res.stderr and "Resource temporarily unavailable" in res.stderr:
            tail = f"[hit the process limit ({self.settings.limits.nproc})] {tail}"
        return f"{truncate(out, self.output_limit)}\n{tail}".lstrip("\n")

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.cwd}/{path}"

    async def read_file(self, path: str) -> str:
        data = await self.sandbox.read_file(self._path(path), max_bytes=4 * self.output_limit)
        return truncate(data.decode(errors="replace"), self.output_limit)

    async def write_file(self, path: str, content: str) -> str:
        await self.sandbox.write_file(self._path(path), content)
        return f"wrote {len(content.encode())} bytes to {self._path(path)}"

    async def str_replace(self, path: str, old: str, new: str) -> str:
        text = (await self.sandbox.read_file(self._path(path), max_bytes=1 << 24)).decode()
        count = text.count(old)
        if count != 1:
            raise ValueError(f"{path}: the text to replace occurs {count} times (it must occur exactly once)")
        await self.sandbox.write_file(self._path(path), text.replace(old, new, 1))
        return f"edited {self._path(path)}"

    # ---- oracle and verification -------------------------------------------------------------------

    async def begin_step(self, step: TaskStep) -> None:
        """A multi-step task's step begins: its workdir/ copied into the working directory, then its
        setup.sh (if any) run there, then its healthcheck polled. TaskUnsupported when the setup
        fails, StepUnhealthy when the healthcheck never passes."""
        workdir = step.part("workdir")
        if workdir is not None:
            for f in task_files(self.task.path, workdir):
                await self.sandbox.write_file(f"{self.cwd}/{f.relative_to(workdir)}", f.read_bytes())
            if (workdir / "setup.sh").is_file():
                res = await self._exec("bash setup.sh", self.task.config.environment.build_timeout_sec)
                if not res.ok:
                    raise TaskUnsupported(
                        f"{workdir / 'setup.sh'}: exit {res.returncode}: {(res.stderr or res.stdout).strip()[-300:]!r}"
                    )
        if (check := step.config.healthcheck) is not None:
            await asyncio.sleep(check.start_period_sec)
            for attempt in range(check.retries):
                res = await self._exec(check.command, check.timeout_sec)
                if res.ok:
                    return
                if attempt + 1 < check.retries:
                    await asyncio.sleep(check.interval_sec)
            raise StepUnhealthy(
                f"step {step.name}: healthcheck `{check.command}` failed {check.retries} times: "
                f"{(res.stderr or res.stdout).strip()[-200:]!r}"
            )

    async def run_solution(self, step: TaskStep | None = None) -> ExecResult:
        """The task's (or the step's) solution/ at /solution, then `bash /solution/solve.sh` (its
        [solution] env)."""
        solution = self.task.solution_dir if step is None else step.part("solution")
        if solution is None:
            raise TaskError(f"{self.task.path if step is None else step.root}: no solution/solve.sh")
        await self._copy_tree(solution, "solution")
        timeout = (step and step.config.agent.timeout_sec) or self.task.config.agent.timeout_sec or 600.0
        return await self._exec("bash /solution/solve.sh", timeout, self.task.config.solution.env)

    async def _copy_tree(self, source: Path, sub: str) -> None:
        root = self.sandbox.path / sub  # type: ignore[operator]
        shutil.rmtree(root, ignore_errors=True)
        await self.sandbox.make_dir(sub)
        for f in task_files(self.task.path, source):  # links and special files out of the task refused
            await self.sandbox.write_file(f"{sub}/{f.relative_to(source)}", f.read_bytes())

    async def _copy_tests(self, step: TaskStep | None) -> None:
        """/tests: the task's tests/, then a step's own laid over it (its files win)."""
        if self.task.tests_dir.is_dir():
            await self._copy_tree(self.task.tests_dir, "tests")
        else:
            shutil.rmtree(self.sandbox.path / "tests", ignore_errors=True)  # type: ignore[operator]
            await self.sandbox.make_dir("tests")
        if step is not None and (own := step.part("tests")) is not None:
            for f in task_files(self.task.path, own):
                await self.sandbox.write_file(f"tests/{f.relative_to(own)}", f.read_bytes())

    async def verify(self, step: TaskStep | None = None) -> VerifierResult:
        """Run the verifier (a multi-step task's: `step`'s tests over the task's, its env and timeout)."""
        t0 = time.monotonic()
        await self._copy_tests(step)
        shutil.rmtree(self.sandbox.path / "logs", ignore_errors=True)  # type: ignore[operator]
        await self.sandbox.make_dir("logs/verifier")
        cfg = self.task.config.verifier
        timeout = (step and step.config.verifier.timeout_sec) or cfg.timeout_sec
        env = {**cfg.env, **(step.config.verifier.env if step else {})}
        res = await self._exec("bash /tests/test.sh", timeout, env)
        output = truncate(res.stdout + res.stderr, 4000)
        seconds = time.monotonic() - t0
        if res.timed_out:
            return VerifierResult(None, "timeout", seconds, output)
        reward, status, named = await self._read_reward()
        if reward is not None and not _admissible(reward, cfg.reward_range):
            output = f"reward {reward!r} is not finite or outside reward_range {cfg.reward_range}\n" + output
            reward, status = None, "bad_reward"
        if reward is None and status == "no_reward" and not res.ok:
            status = "crashed"
        return VerifierResult(reward, status, seconds, output, named)

    async def _read_reward(self) -> tuple[float | None, str, dict[str, float] | None]:
        logs = self.sandbox.path / "logs" / "verifier"  # type: ignore[operator]
        try:  # the sandbox wrote these: read without following a link out of it
            if (text := read_sandbox_file(logs / "reward.txt")) is not None:
                return float(text.strip()), "ok", None
            if (text := read_sandbox_file(logs / "reward.json")) is not None:
                reward, named = _json_reward(json.loads(text))
                return reward, "ok", named
        except (ValueError, KeyError, TypeError):
            return None, "bad_reward", None
        if any((logs / n).is_symlink() for n in ("reward.txt", "reward.json")):
            return None, "bad_reward", None
        return None, "no_reward", None


def _json_reward(data: object) -> tuple[float, dict[str, float] | None]:
    """reward.json's reward (its "reward", else the mean of its named rewards) and the named ones."""
    if not isinstance(data, dict) or not data:
        raise ValueError("reward.json: not an object of named rewards")
    named = {str(k): float(v) for k, v in data.items() if not isinstance(v, bool)}
    if len(named) != len(data):
        raise ValueError("reward.json: a reward that is not a number")
    if "reward" in named:
        return named["reward"], (named if len(named) > 1 else None)
    return sum(named.values()) / len(named), (named if len(named) > 1 else None)


def _admissible(reward: float, bounds: tuple[float, float] | None) -> bool:
    """A verifier's reward is trained on only when finite and, if the task declares one, within its range."""
    return math.isfinite(reward) and (bounds is None or bounds[0] <= reward <= bounds[1])
