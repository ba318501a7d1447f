"""The apptainer sandbox backend run for real (where apptainer and the test images are installed:
containers/apptainer.sh, containers/stand-in-images.sh): commands run in the task's own image as an
unprivileged user, and die with a killed owner. Isolation, limits and verification through this
backend are tested with the local one in tests/unit/test_harbor_tasks.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from owned_processes import left_after, left_after_owner_killed, pids_running

from miles.agentic.harbor.episode import Episode
from miles.agentic.harbor.task import load_task
from miles.agentic.sandbox.base import SandboxStartError
from miles.agentic.sandbox.container import ContainerSandboxConfig

TASK = """version = "1.0"
[verifier]
timeout_sec = 20
"""


def _task(root: Path, image: str) -> Path:
    files = {
        "task.toml": TASK,
        "instruction.md": "Look around.\n",
        "environment/Dockerfile": f"FROM {image}\nWORKDIR /app\n",
        "tests/test.sh": "mkdir -p /logs/verifier; echo 0 > /logs/verifier/reward.txt\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _bash(task_dir: Path, backend: ContainerSandboxConfig, command: str) -> str:
    async def go():
        async with Episode(load_task(task_dir), backend=backend) as ep:
            return await ep.bash(command)

    return asyncio.run(go())


def test_commands_run_in_the_tasks_own_image_as_an_unprivileged_user(tmp_path, apptainer_images) -> None:
    backend = ContainerSandboxConfig(runtime="apptainer", image_dir=apptainer_images)
    probe = "command -v python3 || echo no-python; id -u; echo $HOME; pwd; ls /sandbox"
    slim = _bash(_task(tmp_path / "slim", "debian:bookworm-slim"), backend, probe)
    python = _bash(_task(tmp_path / "py", "python:3.11-slim"), backend, probe)
    # the host has python3 (it runs these tests); the slim image has not, so the image is what runs
    assert slim.startswith("no-python\n") and python.startswith("/usr/bin/python3\n"), (slim, python)
    uid = "65534" if os.getuid() == 0 else str(os.getuid())
    assert f"\n{uid}\n/sandbox\n/app\n" in python and python.endswith("[exit code 0]")


def test_runs_from_a_working_directory_the_sandbox_user_cannot_open(
    tmp_path, apptainer_images, monkeypatch
) -> None:
    """`miles train` run from a private directory (mktemp -d is 0700): apptainer, run as uid 65534,
    used to fail there with "Failed to open current working directory" and every verifier crashed."""
    backend = ContainerSandboxConfig(runtime="apptainer", image_dir=apptainer_images)
    task = _task(tmp_path / "t", "debian:bookworm-slim")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.chdir(private)
    out = _bash(task, backend, "echo ran")
    assert out.startswith("ran\n") and out.endswith("[exit code 0]"), out


def test_an_image_missing_from_the_image_dir_names_the_pull_command(tmp_path, apptainer_images) -> None:
    backend = ContainerSandboxConfig(runtime="apptainer", image_dir=apptainer_images)
    with pytest.raises(SandboxStartError, match=r"apptainer pull .*/rust_1\.80\.sif docker://rust:1\.80"):
        _bash(_task(tmp_path / "rust", "rust:1.80"), backend, "true")


def _holding(path: str) -> list[int]:
    """Processes with `path` open (apptainer's FUSE helper holds the image it mounts)."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{p}/fd/{fd}") == path for fd in os.listdir(f"/proc/{p}/fd")):
                pids.append(int(p))
        except OSError:
            pass
    return pids


def test_a_command_stopped_at_its_wall_time_leaves_nothing_running(tmp_path, apptainer_images) -> None:
    """The wall-time kill reaches every process of the container: the command, apptainer's runtime
    parent and the FUSE helper that mounts the image (which, orphaned, would live on forever)."""
    marker = f"79{os.getpid()}{id(tmp_path) % 10**6}"
    backend = ContainerSandboxConfig(runtime="apptainer", image_dir=apptainer_images)
    image = os.path.join(apptainer_images, "debian_bookworm-slim.sif")
    before = set(_holding(image))

    async def go():
        async with Episode(load_task(_task(tmp_path / "t", "debian:bookworm-slim")), backend=backend) as ep:
            return await ep.bash(f"sleep {marker}", timeout_s=1.0)

    out = asyncio.run(go())
    assert out.endswith("[stopped: wall_time after 1 s]"), out
    assert left_after(lambda: pids_running(marker)) == []
    assert left_after(lambda: [p for p in _holding(image) if p not in before]) == []


def test_container_commands_die_with_a_killed_owner(tmp_path, apptainer_images) -> None:
    marker = f"78{os.getpid()}{id(tmp_path) % 10**6}"
    task = _task(tmp_path / "t", "debian:bookworm-slim")
    # a killed owner leaves its episode directory behind (nobody is left to wipe it): keep it out of
    # the shared sandbox root, in a world-searchable one of this test's own
    root = Path(tempfile.mkdtemp(prefix="miles-sbtest-"))
    root.chmod(0o755)
    code = (
        "import asyncio\n"
        "from miles.agentic.harbor.episode import Episode\n"
        "from miles.agentic.harbor.task import load_task\n"
        "from miles.agentic.sandbox.container import ContainerSandboxConfig\n"
        "async def main():\n"
        f"    backend = ContainerSandboxConfig(runtime='apptainer', image_dir={apptainer_images!r}, root={str(root)!r})\n"
        f"    async with Episode(load_task({str(task)!r}), backend=backend) as ep:\n"
        "        print('started', flush=True)\n"
        f"        await ep.bash('sleep {marker}', timeout_s=600)\n"
        "asyncio.run(main())\n"
    )
    try:
        assert left_after_owner_killed(code, marker) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
