"""Harbor-format tasks: the reader (fields, defaults, malformed tasks named by file and field), the
episode path in real sandboxes (tools, verification, masking, planted rewards, refusals, isolation) on
both backends, bubblewrap with the host's toolchain and apptainer running each task's own image, and
`miles tasks check` on the shipped and generated tasks through the real CLI."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.agentic.harbor.episode import Episode, TaskUnsupported
from miles.agentic.harbor.generate import generate
from miles.agentic.harbor.task import TaskError, load_dataset, load_task
from miles.agentic.sandbox.container import ContainerSandboxConfig

SHIPPED = Path(__file__).resolve().parents[2] / "tasks"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(params=["local", "apptainer"])
def backend(request) -> ContainerSandboxConfig | None:
    """The sandbox backend an episode runs on: None (bubblewrap) or apptainer with the test images."""
    if request.param == "local":
        if shutil.which("bwrap") is None:
            pytest.skip("bubblewrap is not installed")
        return None
    return ContainerSandboxConfig(runtime="apptainer", image_dir=request.getfixturevalue("apptainer_images"))


def runtime_args(backend: ContainerSandboxConfig | None) -> list[str]:
    """`miles tasks check` arguments selecting `backend`."""
    return [] if backend is None else ["--runtime", backend.runtime, "--image-dir", str(backend.image_dir)]


TOML = """version = "1.0"
[verifier]
timeout_sec = {verifier}
[environment]
memory = "1G"
"""


def _task(root: Path, test_sh: str, toml: str | None = None, dockerfile: str = "FROM debian:bookworm-slim\nWORKDIR /app\n",
          solve: str | None = None) -> Path:  # fmt: skip
    files = {
        "task.toml": toml or TOML.format(verifier=20),
        "instruction.md": "Do the thing.\n",
        "environment/Dockerfile": dockerfile,
        "tests/test.sh": test_sh,
    }
    if solve is not None:
        files["solution/solve.sh"] = solve
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


REWARD_IF_DONE = "mkdir -p /logs/verifier\n[ -f /app/done ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"


def test_reader_fields_defaults_and_deprecated_sizes(tmp_path) -> None:
    t = load_task(_task(tmp_path / "t", REWARD_IF_DONE))
    assert t.config.schema_version == "1.0" and t.config.verifier.timeout_sec == 20
    assert t.config.environment.memory_mb == 1024 and t.config.environment.cpus == 1
    assert (
        t.config.agent.timeout_sec is None
        and t.base_image == "debian:bookworm-slim"
        and t.instruction == "Do the thing.\n"
    )
    assert [s.kind for s in t.steps] == ["workdir"] and t.solution_dir is None
    full = load_task(SHIPPED / "git-commit")
    envs = [s.args for s in full.steps if s.kind == "env"]
    assert ("GIT_AUTHOR_EMAIL", "agent@example.com") in envs and ("GIT_COMMITTER_NAME", "agent") in envs


@pytest.mark.parametrize(
    "change,message",
    [
        ({"task.toml": "version = 1.0\n[verifier\n"}, "task.toml: not valid TOML"),
        ({"task.toml": '[verifier]\ntimeout_sec = "soon"\n'}, "task.toml: [verifier] timeout_sec"),
        ({"task.toml": '[environment]\nmemory = "lots"\n'}, "needs a unit suffix"),
        ({"instruction.md": ""}, "instruction.md: missing or empty"),
        (
            {"environment/Dockerfile": "FROM x\nFROBNICATE now\n"},
            "Dockerfile:2: unknown Dockerfile instruction",
        ),
        ({"environment/Dockerfile": "FROM x\nCOPY --from=build /a /app\n"}, "only local sources"),
    ],
)
def test_malformed_tasks_are_refused_naming_file_and_field(tmp_path, change, message) -> None:
    root = _task(tmp_path / "t", REWARD_IF_DONE)
    for rel, text in change.items():
        (root / rel).write_text(text)
    with pytest.raises(TaskError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_task(root)
    untested = _task(tmp_path / "untested", REWARD_IF_DONE)
    (untested / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match="test.sh: missing"):
        load_task(untested)


def test_datasets_are_folders_or_lists_of_tasks(tmp_path) -> None:
    generate(tmp_path / "gen", 3, seed=1)
    names = [t.name for t in load_dataset([tmp_path / "gen", SHIPPED / "greet-script"])]
    assert len(names) == 4 and names[-1] == "greet-script"
    assert [t.name for t in load_dataset([tmp_path / "gen"])] == sorted(names[:3])
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="neither a task"):
        load_dataset([tmp_path / "empty"])


def test_tools_in_a_fresh_sandbox_and_nothing_left_after(tmp_path, backend) -> None:
    task = load_task(SHIPPED / "fix-median")

    async def go():
        async with Episode(task, output_limit=200, backend=backend) as ep:
            root = ep.sandbox.path
            listing = await ep.bash("ls /app /tests; pwd")
            long = await ep.bash("seq 1 500")
            failed = await ep.bash("exit 3")
            hung = await ep.bash("sleep 30", timeout_s=0.5)
            await ep.write_file("notes/a.txt", "one two")
            edited = await ep.str_replace("notes/a.txt", "two", "three")
            text = await ep.read_file("/app/notes/a.txt")
            with pytest.raises(ValueError, match="occurs 0 times"):
                await ep.str_replace("notes/a.txt", "four", "five")
            return root, listing, long, failed, hung, edited, text

    root, listing, long, failed, hung, edited, text = asyncio.run(go())
    assert "stats.py" in listing and listing.rstrip().endswith("[exit code 0]") and "/app\n" in listing
    assert "test_stats.py" not in listing  # /tests stays empty until verification
    assert "characters cut" in long and "500" in long and "\n1\n" not in long[150:]
    assert failed.endswith("[exit code 3]") and "[stopped: wall_time after 0.5 s]" in hung
    assert text == "one three" and edited == "edited /app/notes/a.txt"
    assert not root.exists()


def test_verification_reads_rewards_masks_failures_and_ignores_planted_ones(tmp_path, backend) -> None:
    def verdict(root: Path, agent: str | None = None):
        async def go():
            async with Episode(load_task(root), backend=backend) as ep:
                if agent:
                    await ep.bash(agent)
                return await ep.verify()

        return asyncio.run(go())

    plain = _task(tmp_path / "plain", REWARD_IF_DONE)
    assert verdict(plain).reward == 0.0
    assert verdict(plain, "touch /app/done").reward == 1.0
    # an agent that plants a reward and its own test script gains nothing
    planted = (
        "mkdir -p /logs/verifier /tests; echo 1 > /logs/verifier/reward.txt; echo 'exit 0' > /tests/test.sh"
    )
    assert verdict(plain, planted).reward == 0.0
    as_json = _task(
        tmp_path / "json", "mkdir -p /logs/verifier; echo '{\"reward\": 0.25}' > /logs/verifier/reward.json\n"
    )
    assert verdict(as_json).reward == 0.25
    crash = verdict(_task(tmp_path / "crash", "exit 2\n"))
    assert crash.reward is None and crash.status == "crashed"
    slow = verdict(_task(tmp_path / "slow", "sleep 30\n", toml=TOML.format(verifier=0.5)))
    assert slow.reward is None and slow.status == "timeout"
    bad = verdict(_task(tmp_path / "bad", "mkdir -p /logs/verifier; echo yes > /logs/verifier/reward.txt\n"))
    assert bad.reward is None and bad.status == "bad_reward"


@needs_bwrap
def test_tasks_the_host_cannot_run_are_refused_with_the_reason(tmp_path) -> None:
    def start(root: Path) -> None:
        async def go():
            async with Episode(load_task(root)):
                pass

        asyncio.run(go())

    needs_tool = _task(
        tmp_path / "tool", REWARD_IF_DONE, dockerfile="FROM rust:1\nRUN cargo-frobnicate --version\n"
    )
    with pytest.raises(TaskUnsupported, match=r"Dockerfile:2: RUN 'cargo-frobnicate --version' failed here"):
        start(needs_tool)
    image_only = _task(
        tmp_path / "img", REWARD_IF_DONE, toml='[environment]\ndocker_image = "ghcr.io/x/y:1"\n'
    )
    (image_only / "environment" / "Dockerfile").unlink()
    with pytest.raises(TaskUnsupported, match="docker_image"):
        start(image_only)
    outside = _task(tmp_path / "out", REWARD_IF_DONE, dockerfile="FROM x\nWORKDIR /srv\n")
    with pytest.raises(TaskUnsupported, match="outside /app"):
        start(outside)


def test_miles_tasks_check_passes_shipped_and_generated_tasks_and_fails_broken_ones(
    tmp_path, backend
) -> None:
    generate(tmp_path / "gen", 4, seed=3)
    check = [sys.executable, "-m", "miles", "tasks", "check", *runtime_args(backend)]
    out = subprocess.run(
        [*check, str(SHIPPED), str(tmp_path / "gen")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8/8 tasks passed" in out.stdout and "fix-median" in out.stdout
    wrong = _task(tmp_path / "bad" / "wrong-oracle", REWARD_IF_DONE, solve="#!/bin/bash\ntrue\n")
    free = _task(
        tmp_path / "bad" / "free-reward", "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n"
    )
    loud = _task(
        tmp_path / "bad" / "loud-fail",
        "echo 'AssertionError: expected 42 in /app/out'\nmkdir -p /logs/verifier; echo 0 > /logs/verifier/reward.txt\n",
        solve="#!/bin/bash\ntrue\n",
    )
    out = subprocess.run(
        [*check, "--internet", "off", str(tmp_path / "bad")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1 and "0/3 tasks passed" in out.stdout, out.stdout
    assert "| AssertionError: expected 42 in /app/out" in out.stdout  # the verifier's tail under its row
    assert (
        "allow_internet (Harbor's default) and its episodes ran without network: internet: off" in out.stdout
    )
    assert loud.name in out.stdout
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:-1] if not line.startswith(" ")}
    assert rows[wrong.name].split()[1:4] == ["0", "0", "FAILED:"]
    assert "the oracle (solution/solve.sh) scored 0" in rows[wrong.name]
    assert rows[free.name].split()[1:4] == ["-", "1", "FAILED:"]
    assert "the do-nothing agent scored 1" in rows[free.name]


def test_episodes_are_isolated_and_runaway_commands_are_stopped_and_reported(tmp_path, backend) -> None:
    """Two episodes at once: neither sees the other's files or the host's run directory; no network; a
    disk filler, a fork bomb and a memory hog are stopped and the tool output says so."""
    toml = TOML.format(verifier=20) + "storage_mb = 64\nallow_internet = false\n"
    image = "FROM python:3.11-slim\nWORKDIR /app\n"
    task = load_task(_task(tmp_path / "iso", REWARD_IF_DONE, toml=toml, dockerfile=image))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_text("weights")

    async def go():
        async with Episode(task, backend=backend) as a, Episode(task, backend=backend) as b:
            await a.write_file("secret.txt", "only a")
            seen = await b.bash(
                f"cat /app/secret.txt; ls /tmp /sandbox; find / -name secret.txt 2>/dev/null; ls {run_dir}"
            )
            net = await b.bash("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"")
            disk = await b.bash("head -c 100M /dev/zero > big.bin", timeout_s=20)
            fork = await b.bash("for i in $(seq 300); do sleep 3 & done; wait", timeout_s=10)
            hog = await b.bash('python3 -c "x = bytearray(8 << 30)"', timeout_s=20)
            alive = await b.bash("echo still here")
            return seen, net, disk, fork, hog, alive

    seen, net, disk, fork, hog, alive = asyncio.run(go())
    assert "only a" not in seen and "/app/secret.txt: No such file" in seen and "checkpoint.pt" not in seen
    assert "Network is unreachable" in net and net.endswith("[exit code 1]")
    assert disk.endswith("[stopped: file_size]")
    assert "[hit the process limit" in fork
    assert "MemoryError" in hog and hog.endswith("[stopped: memory]")
    assert alive.startswith("still here") and alive.endswith("[exit code 0]")


def test_buildkit_run_flags_are_read_as_flags_not_as_the_command(tmp_path) -> None:
    """Terminal-Bench 2's Dockerfiles write `RUN --network=host pip install ...`: the flags are taken
    as BuildKit's (noted), the command is what follows; a bind or secret mount is refused by name."""
    from miles.agentic.harbor.task import TaskError, parse_dockerfile

    f = tmp_path / "Dockerfile"
    f.write_text(
        "FROM python:3.12\nRUN --network=host --mount=type=cache,target=/root/.cache pip install rich\n"
    )
    image, steps, notes = parse_dockerfile(f)
    assert image == "python:3.12" and steps[0].args == ("pip install rich",)
    assert any("--network=host" in n for n in notes) and any("--mount=type=cache" in n for n in notes)
    f.write_text("FROM python:3.12\nRUN --mount=type=secret,id=tok cat /run/secrets/tok\n")
    with pytest.raises(TaskError, match=r"Dockerfile:2: RUN --mount=type=secret,id=tok: a build flag"):
        parse_dockerfile(f)


def test_a_task_with_sidecar_containers_is_a_row_naming_compose(tmp_path) -> None:
    """A task with sidecar containers (a compose file beside the Dockerfile) is refused by name, a row
    of the check, the others still checked."""
    ok = _task(tmp_path / "set" / "fine", REWARD_IF_DONE, solve="#!/bin/bash\ntouch /app/done\n")
    sidecar = _task(tmp_path / "set" / "sidecar", REWARD_IF_DONE)
    (sidecar / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    depends_on: [api]\n  api:\n    build: {context: ./api}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "miles", "tasks", "check", str(tmp_path / "set")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1 and "1/2 tasks passed" in out.stdout, out.stdout + out.stderr
    assert "sidecar containers (api) started by docker compose" in out.stdout
    assert ok.name in out.stdout
