"""When a run fails on a full file system, say so where it can still be read.

A trainer that runs out of space fails somewhere deep in a write, and the log that would name the
cause is on the same full file system, cut mid-line. So the launcher, after a failure, looks at the
file system of the run directory itself: when it has less than `FULL_BELOW_BYTES` free, or the
trainer's last error is ENOSPC's message, it prints one line on stderr naming the mount point, the
free bytes and what to do, and writes the same report, with the trainer's last error, to a log on
another file system (the first of $TMPDIR, /tmp, /dev/shm and ~/.cache/miles whose device differs
from the run directory's and that takes the write). Files already written stay as they are:
checkpoints count only with their marker, metrics.jsonl lines are whole (miles/metrics.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

FULL_BELOW_BYTES = 1 << 20
NO_SPACE = os.strerror(28)  # "No space left on device"


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding `path`."""
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def full_file_system(run_dir: Path, error_text: str = "") -> str | None:
    """A message naming the full file system of `run_dir`, or None when it is not full."""
    try:
        free = free_bytes(run_dir)
    except OSError:
        return None
    if free >= FULL_BELOW_BYTES and NO_SPACE not in error_text:
        return None
    return (
        f"the file system at {mount_point(run_dir)} (holding {run_dir}) is full: {free} bytes free. "
        "Free space there or set run.runs_root to another file system, then continue the run with --resume"
    )


def write_elsewhere(run_dir: Path, text: str) -> Path | None:
    """Write `text` to a log on a file system other than run_dir's; its path, or None if none took it."""
    try:
        device = os.stat(run_dir).st_dev
    except OSError:
        device = None
    candidates = [os.environ.get("TMPDIR"), "/tmp", "/dev/shm", str(Path.home() / ".cache" / "miles")]
    name = f"miles-{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for folder in filter(None, candidates):
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            if os.stat(folder).st_dev == device:
                continue
            path = Path(folder) / name
            path.write_text(text)
            return path
        except OSError:
            continue
    return None
