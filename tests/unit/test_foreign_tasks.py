"""Ten tasks written in other authors' shapes (tests/foreign_tasks/README.md) through the commands a
user runs: convert the Terminal-Bench 1 task, build every image, check every task. The tasks whose
needs this machine meets score 1 with their oracle and 0 doing nothing; each other task is a row
naming what it needs (docker compose sidecars; root and the internet in its verifier; its ENTRYPOINT)
and the check exits 1 without stopping at any of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

FOREIGN = Path(__file__).resolve().parents[1] / "foreign_tasks"
COMPOSE = ("computer-use-ubuntu", "mcp-tools", "multi-container", "simulated-user")
NEEDS_NET = ("dns-blacklisting", "multi-reward", "simple-task")
OK = ("multi-step", "tb1-count-errors", "tb2-log-summary")


def _miles(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_ten_foreign_tasks_are_converted_built_and_checked(apptainer_images) -> None:
    if os.geteuid() != 0:
        pytest.skip("runs as root (as CI does); the rootless build has its own test")
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="miles-foreign-"))
    try:
        work.chmod(0o755)
        images, tasks = work / "images", work / "tasks"
        images.mkdir(mode=0o755)
        for f in Path(apptainer_images).glob("*.sif"):  # the stand-in bases (and their aliases)
            (images / f.name).symlink_to(f.resolve())
        shutil.copytree(FOREIGN, tasks, ignore=shutil.ignore_patterns("tb1-*", "README.md"))
        conv = _miles("tasks", "convert", str(FOREIGN / "tb1-count-errors"), "--out", str(tasks), timeout=60)
        assert conv.returncode == 0, conv.stdout + conv.stderr

        build = _miles("tasks", "build", str(tasks), "--image-dir", str(images), timeout=1800)
        rows = dict(line.split(": ", 1) for line in build.stdout.splitlines() if ": " in line)
        assert build.returncode == 1 and sorted(rows) == sorted((*COMPOSE, *NEEDS_NET, *OK)), build.stdout
        assert all(rows[t].startswith("built ") for t in (*NEEDS_NET, *OK)), build.stdout + build.stderr
        assert all("docker compose" in rows[t] for t in COMPOSE)

        check = _miles("tasks", "check", str(tasks), "--runtime", "apptainer", "--image-dir", str(images),
                       "--internet", "off", timeout=900)  # fmt: skip
        out = check.stdout
        assert check.returncode == 1 and "3/10 tasks passed" in out, out + check.stderr
        verdicts = {line.split()[0]: line for line in out.splitlines()[1:-1] if not line.startswith(" ")}
        blocks = _row_blocks(out)
        for t in OK:
            assert verdicts[t].split()[1:4] == ["1", "0", "ok"], blocks[t]
        for t in COMPOSE:
            assert "ERROR:" in verdicts[t] and "started by docker compose" in verdicts[t]
        for t in NEEDS_NET:
            assert "FAILED:" in verdicts[t] and "ran without network: internet: off" in blocks[t], blocks[t]
            assert "installs packages as root" in blocks[t], blocks[t]
        assert "Dockerfile:14: the image's ENTRYPOINT is not run" in blocks["dns-blacklisting"]
        assert "oracle's rewards: correctness=0, speed=0" in blocks["multi-reward"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _row_blocks(table: str) -> dict[str, str]:
    """Each task's row with the indented lines under it."""
    blocks: dict[str, list[str]] = {}
    name = None
    for line in table.splitlines()[1:-1]:
        if not line.startswith(" "):
            name = line.split()[0]
        blocks.setdefault(name, []).append(line)
    return {k: "\n".join(v) for k, v in blocks.items()}
