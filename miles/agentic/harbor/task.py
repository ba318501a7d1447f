"""Harbor-format tasks (the format of Terminal-Bench 2 and many agent datasets), read without Docker.

A task is a directory:

    task.toml          version; [metadata]; [verifier] timeout_sec, env; [agent] timeout_sec;
                       [environment] build_timeout_sec, docker_image, cpus, memory_mb, storage_mb, ...;
                       [solution] env
    instruction.md     what the agent is asked to do
    environment/       Dockerfile (its build context: typically `WORKDIR /app` and COPY of files)
    tests/test.sh      the verifier, copied to /tests at verification only (+ helper files)
    solution/solve.sh  optional oracle

The `harbor` package needs Python >= 3.12, so this reader follows Harbor's documented TaskConfig
schema itself: the same section and field names and defaults, the deprecated `version` key and
`memory` / `storage` size strings accepted, unknown keys ignored as Harbor ignores them. A malformed
task raises TaskError naming the file and the field. A dataset is a folder of task directories (or a
list of paths, each a task or a dataset).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miles.agentic.harbor.files import TaskError, check_tree


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore")


class VerifierSection(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = {}
    reward_range: tuple[float, float] | None = None
    """Miles' key (Harbor ignores it): rewards outside [low, high] mask the sample (`bad_reward`)."""

    @model_validator(mode="after")
    def _ordered(self) -> VerifierSection:
        if self.reward_range is not None and not self.reward_range[0] <= self.reward_range[1]:
            raise ValueError(f"reward_range {list(self.reward_range)}: low must not exceed high")
        return self


class AgentSection(_Section):
    timeout_sec: float | None = Field(None, gt=0)


class SolutionSection(_Section):
    env: dict[str, str] = {}


def _size_mb(text: str) -> int:
    t = text.strip().upper()
    factor = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}.get(t[-1:])
    if factor is None:
        raise ValueError(f"size {text!r} needs a unit suffix G, M or K (e.g. '2G')")
    return int(float(t[:-1]) * factor)


class EnvironmentSection(_Section):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = None
    cpus: int = Field(1, ge=1)
    memory_mb: int = Field(2048, ge=1)
    storage_mb: int = Field(10240, ge=1)
    gpus: int = Field(0, ge=0)
    allow_internet: bool = True
    env: dict[str, str] = {}

    @model_validator(mode="before")
    @classmethod
    def _deprecated_sizes(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for old, new in (("memory", "memory_mb"), ("storage", "storage_mb")):
                if old in data:
                    data.setdefault(new, _size_mb(str(data.pop(old))))
        return data


class StepVerifier(_Section):
    timeout_sec: float | None = Field(None, gt=0)
    env: dict[str, str] = {}


class Healthcheck(_Section):
    """[steps.healthcheck]: a command that must pass before the step's agent turn, polled as Docker's
    HEALTHCHECK is (up to `retries` tries, `interval_sec` apart, each within `timeout_sec`)."""

    command: str = Field(min_length=1)
    interval_sec: float = Field(1.0, ge=0)
    timeout_sec: float = Field(30.0, gt=0)
    retries: int = Field(3, ge=1)
    start_period_sec: float = Field(0.0, ge=0)


class StepSection(_Section):
    """One [[steps]] entry (Harbor's schema 1.1): its files live in steps/<name>/."""

    name: str = Field(min_length=1)
    min_reward: float | None = None
    """The episode stops after this step when its reward is below this."""
    contributes_to_mean: bool = True
    agent: AgentSection = AgentSection()
    verifier: StepVerifier = StepVerifier()
    healthcheck: Healthcheck | None = None


class TaskConfig(_Section):
    """task.toml."""

    schema_version: str = "1.0"
    metadata: dict[str, Any] = {}
    verifier: VerifierSection = VerifierSection()
    agent: AgentSection = AgentSection()
    environment: EnvironmentSection = EnvironmentSection()
    solution: SolutionSection = SolutionSection()
    steps: list[StepSection] = []
    multi_step_reward_strategy: Literal["mean", "final"] = "mean"
    """A multi-step task's reward: the mean over its steps (those not run count 0) or the last run's."""

    @model_validator(mode="before")
    @classmethod
    def _version(cls, data: Any) -> Any:
        if isinstance(data, dict) and "version" in data:
            data = dict(data)
            data.setdefault("schema_version", str(data.pop("version")))
        return data


@dataclass(frozen=True)
class DockerStep:
    """One instruction of environment/Dockerfile the local backend acts on."""

    kind: str  # "workdir" | "copy" | "run" | "env"
    args: tuple[str, ...]
    line: int


@dataclass(frozen=True)
class TaskStep:
    """One step of a multi-step task: steps/<name>/ holds instruction.md, and optionally tests/ (laid
    over the task's tests/), solution/solve.sh and workdir/ (copied into the working directory before
    the agent's turn, its setup.sh run there)."""

    config: StepSection
    root: Path
    instruction: str

    @property
    def name(self) -> str:
        return self.config.name

    def part(self, name: str) -> Path | None:
        d = self.root / name
        return d if d.is_dir() else None


@dataclass(frozen=True)
class Task:
    """One Harbor task directory, read and checked."""

    path: Path
    config: TaskConfig
    instruction: str
    steps: tuple[DockerStep, ...] = ()
    """What environment/Dockerfile does, for the local backend (empty without a Dockerfile)."""
    base_image: str | None = None
    """The Dockerfile's FROM, or [environment] docker_image."""
    notes: tuple[str, ...] = field(default=())
    """Dockerfile instructions the local backend ignores (CMD, EXPOSE, ...), for `miles tasks check`."""
    task_steps: tuple[TaskStep, ...] = ()
    """A multi-step task's steps, in order (empty for a single-step task)."""

    def reward(self, rewards: list[float]) -> float:
        """A multi-step episode's reward from the rewards of the steps it ran (task.toml's strategy)."""
        if self.config.multi_step_reward_strategy == "final":
            return rewards[-1] if rewards else 0.0
        counted = [s.config.contributes_to_mean for s in self.task_steps]
        total = sum(r for r, c in zip(rewards, counted, strict=False) if c)
        return total / max(sum(counted), 1)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path | None:
        d = self.path / "solution"
        return d if (d / "solve.sh").is_file() else None

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"


_IGNORED = {
    "CMD",
    "ENTRYPOINT",
    "EXPOSE",
    "LABEL",
    "HEALTHCHECK",
    "SHELL",
    "STOPSIGNAL",
    "VOLUME",
    "ARG",
    "USER",
}


def parse_dockerfile(path: Path) -> tuple[str | None, list[DockerStep], list[str]]:
    """(FROM image, the steps the local backend runs, notes on ignored instructions) of a Dockerfile.

    Continuation lines (trailing backslash) are joined. COPY/ADD take local sources only (no URLs, no
    --from stages); RUN in exec form (JSON) is refused: the local backend runs shell commands."""
    image, steps, notes = None, [], []
    for n, line in _instructions(path.read_text()):
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        where = f"{path}:{n}"
        if word == "FROM":
            image = rest.split()[0] if rest else None
        elif word == "WORKDIR":
            steps.append(DockerStep("workdir", (rest,), n))
        elif word in ("COPY", "ADD"):
            parts = shlex.split(rest)
            if any(p.startswith("--") for p in parts) or any("://" in p for p in parts):
                raise TaskError(
                    f"{where}: {word} {rest!r}: only local sources without flags can be copied here"
                )
            if len(parts) < 2:
                raise TaskError(f"{where}: {word} needs a source and a destination")
            steps.append(DockerStep("copy", tuple(parts), n))
        elif word == "RUN":
            command, flags = _run_flags(rest, where)
            notes += [f"{where}: RUN {flag} taken as a plain RUN" for flag in flags]
            if command.startswith("["):
                raise TaskError(f"{where}: RUN in exec form (JSON); write it as a shell command")
            steps.append(DockerStep("run", (command,), n))
        elif word == "ENV":
            steps += [DockerStep("env", pair, n) for pair in _env_pairs(rest, where)]
        elif word in _IGNORED:
            notes.append(f"{where}: {word} ignored by the local backend")
        else:
            raise TaskError(f"{where}: unknown Dockerfile instruction {word}")
    return image, steps, notes


_RUN_FLAGS = ("--network=", "--security=", "--mount=type=cache", "--mount=type=tmpfs")
"""BuildKit's RUN flags a build without them still honours in effect: a network mode, a security mode,
a cache or tmpfs mount (a build that starts empty). Bind, secret and ssh mounts bring files the task's
context does not: refused."""


def _run_flags(rest: str, where: str) -> tuple[str, list[str]]:
    """(the shell command, its leading BuildKit flags) of a RUN instruction's text."""
    flags = []
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        if not flag.startswith(_RUN_FLAGS):
            raise TaskError(
                f"{where}: RUN {flag}: a build flag this reader cannot honour (known: --network, --security, "
                "--mount=type=cache, --mount=type=tmpfs)"
            )
        flags.append(flag)
        rest = rest.lstrip()
    return rest, flags


def _instructions(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) of a Dockerfile's text: comments and blank lines dropped,
    continuation lines (trailing backslash) joined."""
    lines: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append((start, buf + stripped))
        buf = ""
    if buf:
        lines.append((start, buf))
    return lines


def _env_pairs(rest: str, where: str) -> list[tuple[str, str]]:
    """The (KEY, VALUE) pairs of an ENV instruction: `K1=V1 K2="V 2"`, or the legacy `KEY VALUE`."""
    first = rest.split(maxsplit=1)[0] if rest else ""
    if "=" not in first:
        key, _, value = rest.partition(" ")
        if not key or not value:
            raise TaskError(f"{where}: ENV needs KEY=VALUE (or KEY VALUE)")
        return [(key, value.strip())]
    pairs = []
    for pair in shlex.split(rest):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise TaskError(f"{where}: ENV {pair!r} is not KEY=VALUE")
        pairs.append((key, value))
    return pairs


def _field_errors(file: Path, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        section = f"[{loc[0]}] " if len(loc) > 1 else ""
        parts.append(f"{file}: {section}{'.'.join(loc[1:] or loc)}: {e['msg']}")
    return "; ".join(parts)


def load_task(path: str | Path) -> Task:
    """Read and check one task directory (TaskError naming the file and field)."""
    root = Path(path)
    toml_file = root / "task.toml"
    if not toml_file.is_file():
        raise TaskError(
            f"{root}: no task.toml (a Harbor task directory has task.toml, instruction.md, tests/)"
        )
    check_tree(root)  # before any of its files is read: no link or special file out of the task
    try:
        raw = tomllib.loads(toml_file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{toml_file}: not valid TOML: {e}") from None
    try:
        config = TaskConfig.model_validate(raw)
    except ValidationError as e:
        raise TaskError(_field_errors(toml_file, e)) from None
    except ValueError as e:  # a size string without a unit
        raise TaskError(f"{toml_file}: [environment]: {e}") from None
    _refuse_unsupported(root)
    task_steps = _task_steps(root, config)
    instruction_file = root / "instruction.md"
    if not task_steps and (not instruction_file.is_file() or not instruction_file.read_text().strip()):
        raise TaskError(f"{instruction_file}: missing or empty (the task's instruction to the agent)")
    if not task_steps and not (root / "tests" / "test.sh").is_file():
        raise TaskError(f"{root / 'tests' / 'test.sh'}: missing (the verifier entry point)")
    solution = root / "solution"
    if solution.is_dir() and not (solution / "solve.sh").is_file():
        raise TaskError(f"{solution / 'solve.sh'}: missing (solution/ exists without its entry point)")
    dockerfile = root / "environment" / "Dockerfile"
    image, steps, notes = config.environment.docker_image, [], []
    if dockerfile.is_file():
        from_image, steps, notes = parse_dockerfile(dockerfile)
        image = image or from_image
    elif not config.environment.docker_image:
        raise TaskError(
            f"{root}: neither environment/Dockerfile nor [environment] docker_image in {toml_file.name}"
        )
    instruction = instruction_file.read_text() if instruction_file.is_file() else ""
    return Task(root, config, instruction, tuple(steps), image, tuple(notes), task_steps)


def _task_steps(root: Path, config: TaskConfig) -> tuple[TaskStep, ...]:
    """The steps of a multi-step task, each checked: steps/<name>/instruction.md, and a test.sh of its
    own or the task's (TaskError naming the file)."""
    out = []
    for step in config.steps:
        d = root / "steps" / step.name
        text = (d / "instruction.md").read_text() if (d / "instruction.md").is_file() else ""
        if not text.strip():
            raise TaskError(f"{d / 'instruction.md'}: missing or empty (step {step.name!r}'s instruction)")
        if not (d / "tests" / "test.sh").is_file() and not (root / "tests" / "test.sh").is_file():
            raise TaskError(
                f"{d / 'tests' / 'test.sh'}: missing, and no tests/test.sh of the task to fall back on"
            )
        if (d / "solution").is_dir() and not (d / "solution" / "solve.sh").is_file():
            raise TaskError(
                f"{d / 'solution' / 'solve.sh'}: missing (solution/ exists without its entry point)"
            )
        out.append(TaskStep(step, d, text))
    if len({s.name for s in out}) != len(out):
        raise TaskError(f"{root / 'task.toml'}: [[steps]] names repeat")
    return tuple(out)


def _refuse_unsupported(root: Path) -> None:
    """TaskError naming the Harbor feature a task uses that Miles does not run: sidecar containers
    (environment/docker-compose.yaml services beyond `main`)."""
    for name in ("docker-compose.yaml", "docker-compose.yml"):
        compose = root / "environment" / name
        if not compose.is_file():
            continue
        import yaml

        try:
            services = (yaml.safe_load(compose.read_text()) or {}).get("services") or {}
        except (yaml.YAMLError, AttributeError):
            raise TaskError(f"{compose}: not a compose file (YAML with `services`)") from None
        sidecars = [str(n) for n in services if n != "main"]
        if sidecars:
            raise TaskError(
                f"{compose}: sidecar containers ({', '.join(sidecars)}) started by docker compose; Miles runs "
                "one container per episode"
            )


def task_dirs(paths: list[str | Path]) -> list[Path]:
    """The task directories of each path: the path itself when it holds task.toml, else its
    sub-directories that do (sorted by name); TaskError for a path that is neither."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "task.toml").is_file():
            found.append(p)
            continue
        if not p.is_dir():
            raise TaskError(f"{p}: not a directory")
        convert = f"convert it to Harbor's format with `miles tasks convert {p} --out DIR`"
        if (p / "task.yaml").is_file():
            raise TaskError(f"{p}: a Terminal-Bench 1 task (task.yaml, run-tests.sh): {convert}")
        inside = sorted(d for d in p.iterdir() if (d / "task.toml").is_file())
        if not inside and any((d / "task.yaml").is_file() for d in p.iterdir() if d.is_dir()):
            raise TaskError(f"{p}: a folder of Terminal-Bench 1 tasks (task.yaml): {convert}")
        if not inside:
            raise TaskError(f"{p}: neither a task (task.toml) nor a folder of tasks")
        found.extend(inside)
    return found


def load_dataset(paths: list[str | Path]) -> list[Task]:
    """Tasks of each path (`task_dirs`): a task directory, or a folder of task directories. A folder
    holding no task, or a task that cannot be read, is an error."""
    return [load_task(d) for d in task_dirs(paths)]
