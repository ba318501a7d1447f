"""Procedural Harbor-format tasks small enough for a tiny model: `miles tasks generate OUT --n N`.

Two kinds, drawn per index from a seeded generator (the same seed and index give the same task):

- `create`: "Create the file NAME.txt in /app containing WORD." The tests compare the file's content
  (surrounding whitespace ignored) with WORD.
- `edit`: /app/settings.txt holds `mode=OLD`; "Change the mode in /app/settings.txt to NEW." The tests
  look for the line `mode=NEW` and no `mode=OLD`.

Each task is a complete Harbor directory (task.toml, instruction.md, environment/Dockerfile, tests/test.sh,
solution/solve.sh): `miles tasks check` runs them like any other, and so would Harbor.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ("alpha", "beta", "gamma", "delta", "notes", "todo", "data", "out")
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "star")

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
"""

TEST_HEAD = """#!/bin/bash
mkdir -p /logs/verifier
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def make_task(out: Path, seed: int, index: int) -> Path:
    """Write task `index` of `seed` into out/<kind>-<index> and return its directory."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choice(("create", "edit"))
    root = out / f"{kind}-{index:04d}"
    if kind == "create":
        name, word = rng.choice(NAMES), rng.choice(WORDS)
        files = {
            "instruction.md": f"Create the file {name}.txt in /app containing {word}.\n",
            "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
            "tests/test.sh": TEST_HEAD
            + f'if [ "$(tr -d "[:space:]" < /app/{name}.txt 2>/dev/null)" = "{word}" ]; then\n'
            + "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n",
            "solution/solve.sh": f"#!/bin/bash\necho {word} > /app/{name}.txt\n",
        }
    else:
        old, new = rng.sample(WORDS, 2)
        files = {
            "instruction.md": f"Change the mode in /app/settings.txt to {new}.\n",
            "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY settings.txt /app/settings.txt\n",
            "environment/settings.txt": f"name=demo\nmode={old}\nlevel=3\n",
            "tests/test.sh": TEST_HEAD
            + f"if grep -qx 'mode={new}' /app/settings.txt && ! grep -q 'mode={old}' /app/settings.txt; then\n"
            + "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n",
            "solution/solve.sh": f"#!/bin/bash\nsed -i 's/^mode=.*/mode={new}/' /app/settings.txt\n",
        }
    _write(root, {"task.toml": TOML.format(kind=kind), **files})
    return root


def generate(out: str | Path, n: int, seed: int = 0, start: int = 0) -> list[Path]:
    """Tasks start .. start + n - 1 of `seed` under `out` (a dataset folder)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [make_task(out, seed, i) for i in range(start, start + n)]
