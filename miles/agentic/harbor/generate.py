"""Procedural Harbor-format tasks small enough for a tiny model: `miles tasks generate OUT --n N`.

Two kinds, drawn per index from a seeded generator (the same seed and index give the same task):

- `create`: "Create the file NAME.txt in /app containing WORD." The tests compare the file's content
  (surrounding whitespace ignored) with WORD.
- `edit`: /app/settings.txt holds `mode=OLD`; "Set mode=NEW in /app/settings.txt." The tests
  look for the line `mode=NEW` and no `mode=OLD`.

Each task is a complete Harbor directory (task.toml, instruction.md, environment/Dockerfile, tests/test.sh,
solution/solve.sh): `miles tasks check` runs them like any other, and so would Harbor.

The tasks are drawn, and the tiny coding model's text written, by miles/models/coding_corpus.py.
"""

from __future__ import annotations

from pathlib import Path

from miles.models.coding_corpus import DrawnTask, draw_task

TOML = """version = "1.0"

[metadata]
generator = "miles.agentic.harbor.generate"
kind = "{kind}"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 60.0

[environment]
cpus = 1
memory_mb = 512
allow_internet = false
"""

TEST_HEAD = """#!/bin/bash
mkdir -p /logs/verifier
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _files(task: DrawnTask) -> dict[str, str]:
    """The task's environment and tests (beside its instruction and solution)."""
    if task.kind == "create":
        check = f'[ "$(tr -d "[:space:]" < /app/{task.name}.txt 2>/dev/null)" = "{task.word}" ]'
        return {
            "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
            "tests/test.sh": _test(check),
        }
    check = f"grep -qx 'mode={task.word}' /app/settings.txt && ! grep -q 'mode={task.old}' /app/settings.txt"
    return {
        "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY settings.txt /app/settings.txt\n",
        "environment/settings.txt": f"name=demo\nmode={task.old}\nlevel=3\n",
        "tests/test.sh": _test(check),
    }


def _test(check: str) -> str:
    return (
        TEST_HEAD
        + f"if {check}; then\n  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n"
    )


def make_task(out: Path, seed: int, index: int) -> Path:
    """Write task `index` of `seed` into out/<kind>-<index> and return its directory."""
    task = draw_task(seed, index)
    root = out / f"{task.kind}-{index:04d}"
    files = {
        "instruction.md": task.instruction + "\n",
        "solution/solve.sh": f"#!/bin/bash\n{task.solution}\n",
        **_files(task),
    }
    _write(root, {"task.toml": TOML.format(kind=task.kind), **files})
    return root


def generate(out: str | Path, n: int, seed: int = 0, start: int = 0) -> list[Path]:
    """Tasks start .. start + n - 1 of `seed` under `out` (a dataset folder)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [make_task(out, seed, i) for i in range(start, start + n)]
