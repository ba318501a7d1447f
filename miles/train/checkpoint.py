"""The checkpoint directory layout every backend shares (no torch here).

    <run_dir>/checkpoints/step_<N>/ ... backend files ... .complete

A checkpoint counts only once its `.complete` marker exists (written last, after every rank has
finished); `mark_complete` writes it and then deletes all but the newest `keep_last` complete ones.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

COMPLETE = ".complete"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(run_dir: str | Path, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<step>`."""
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(s for s in steps if (step_dir(run_dir, s) / COMPLETE).exists())


def latest_complete_step(run_dir: str | Path) -> int | None:
    """The newest step with a complete checkpoint, or None."""
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def mark_complete(run_dir: str | Path, step: int, keep_last: int) -> None:
    """Write step's `.complete` marker (call once, after all its files exist), then prune old ones."""
    (step_dir(run_dir, step) / COMPLETE).write_text(f"{step}\n")
    for old in complete_steps(run_dir)[:-keep_last]:
        shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)
