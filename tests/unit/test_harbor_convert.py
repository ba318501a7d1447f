"""`miles tasks convert`: a Terminal-Bench 1 task (task.yaml, root Dockerfile, solution.sh or
solution.yaml, run-tests.sh with the harness's helper scripts, tests/) rewritten in Harbor's format
passes `miles tasks check` (its oracle scores 1, doing nothing 0); what cannot be converted is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.agentic.harbor.convert import convert_paths
from miles.agentic.harbor.task import TaskError, load_task, task_dirs

TASK_YAML = """# a Terminal-Bench 1 task
instruction: |
  Write the sum of the numbers in /app/numbers.txt to /app/sum.txt.
author_name: Someone Else
author_email: someone@example.com
difficulty: easy
category: file-operations
tags: [bash, arithmetic]
parser_name: pytest
max_agent_timeout_sec: 120
max_test_timeout_sec: 30
"""
RUN_TESTS = """#!/bin/bash
# as Terminal-Bench 1 tasks do: the harness's helpers, then the tests
source $TEST_DIR/setup-uv-pytest.sh
bash $TEST_DIR/run-uv-pytest.sh
"""
TEST_OUTPUTS = """from pathlib import Path


def test_sum():
    assert Path("/app/sum.txt").read_text().strip() == "10"
"""
COMPOSE = """services:
  client:
    build:
      dockerfile: Dockerfile
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    command: ["sh", "-c", "sleep infinity"]
"""


def tb1_task(root: Path, solution: str = "solution.sh", compose: str = COMPOSE) -> Path:
    files = {
        "task.yaml": TASK_YAML,
        "Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\nCOPY numbers.txt /app/numbers.txt\n",
        "numbers.txt": "1\n2\n3\n4\n",
        "docker-compose.yaml": compose,
        "run-tests.sh": RUN_TESTS,
        "tests/test_outputs.py": TEST_OUTPUTS,
    }
    if solution == "solution.sh":
        files["solution.sh"] = "#!/bin/bash\nawk '{s+=$1} END {print s}' /app/numbers.txt > /app/sum.txt\n"
    else:
        files["solution.yaml"] = (
            "- command: awk '{s+=$1} END {print s}' /app/numbers.txt > /app/sum.txt\n  min_timeout_sec: 1\n"
        )
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_check_points_a_terminal_bench_1_task_at_the_converter(tmp_path) -> None:
    src = tb1_task(tmp_path / "tb1" / "sum-numbers")
    with pytest.raises(TaskError, match=r"a Terminal-Bench 1 task .*miles tasks convert"):
        task_dirs([src])
    with pytest.raises(TaskError, match=r"a folder of Terminal-Bench 1 tasks .*miles tasks convert"):
        task_dirs([src.parent])


@pytest.mark.parametrize("solution", ["solution.sh", "solution.yaml"])
def test_a_converted_task_reads_as_harbor_and_passes_the_check(tmp_path, solution) -> None:
    pytest.importorskip("pytest")
    tb1_task(tmp_path / "tb1" / "sum-numbers", solution)
    rows = convert_paths([str(tmp_path / "tb1")], str(tmp_path / "harbor"))
    assert rows == [(str(tmp_path / "tb1" / "sum-numbers"), str(tmp_path / "harbor" / "sum-numbers"))]
    task = load_task(tmp_path / "harbor" / "sum-numbers")
    assert task.instruction.startswith("Write the sum") and task.config.verifier.timeout_sec == 30
    assert task.config.agent.timeout_sec == 120 and task.base_image == "python:3.11-slim"
    assert (task.path / "environment" / "numbers.txt").is_file()
    check = [sys.executable, "-m", "miles", "tasks", "check", str(tmp_path / "harbor")]
    out = subprocess.run(check, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1/1 tasks passed" in out.stdout, out.stdout + out.stderr


def test_what_cannot_be_converted_is_named_and_the_rest_still_is(tmp_path) -> None:
    tb1_task(tmp_path / "tb1" / "good")
    sidecar = COMPOSE + "  redis:\n    image: redis:7\n"
    tb1_task(tmp_path / "tb1" / "with-sidecar", compose=sidecar)
    bad = tb1_task(tmp_path / "tb1" / "no-instruction")
    (bad / "task.yaml").write_text("difficulty: easy\n")
    cmd = [
        sys.executable,
        "-m",
        "miles",
        "tasks",
        "convert",
        str(tmp_path / "tb1"),
        "--out",
        str(tmp_path / "h"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"good -> {tmp_path / 'h' / 'good'}" in out.stdout
    assert "2 services (client, redis)" in out.stdout and "docker compose" in out.stdout
    assert "no instruction" in out.stdout
