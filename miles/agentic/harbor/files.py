"""A task directory is data from strangers: which of its files may be read on the host.

Everything of a task that reaches a sandbox (tests/, solution/, the Dockerfile's COPY sources) is
read here, on the host, with this process's rights, often root's, and then written into the sandbox.
A link or special file would make that read reach beyond the task: `tests/test.sh -> /etc/shadow`
would copy the host's shadow file into the sandbox for the verifier to print. So, before a task is
used and again when its files are copied:
- a symbolic link whose target is outside the task directory (or dangling) is refused;
- a hard link (a regular file with more than one name) is refused: its other name may be anywhere;
- a FIFO, socket or device is refused (opening a FIFO would also block the reader).
Each refusal is a TaskError naming the path. Links that stay inside the task are followed.

The reward file a verifier leaves is read the same way (`read_sandbox_file`): opened without following
a final symlink, and only when it is a regular file, so a verifier cannot point it at a host file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_REWARD_BYTES = 64 * 1024


class TaskError(ValueError):
    """A task directory that cannot be used; the message names the file and the field."""


def _problem(path: Path, root: Path) -> str | None:
    """Why `path` (inside `root`) may not be read, or None."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        target = Path(os.path.realpath(path))
        if not target.exists():
            return f"is a symbolic link to {os.readlink(path)!r}, which does not exist"
        if target != root and root not in target.parents:
            return f"is a symbolic link to {os.readlink(path)!r}, outside the task directory"
        info = target.stat()
    if stat.S_ISDIR(info.st_mode):
        return None
    if not stat.S_ISREG(info.st_mode):
        return "is a FIFO, socket or device file, not a regular file"
    if info.st_nlink > 1:
        return f"is a hard link ({info.st_nlink} names): its other names may be outside the task directory"
    return None


def check_tree(root: Path, sub: Path | None = None) -> None:
    """TaskError naming the first entry of `sub` (default: all of `root`) that may not be read."""
    root = Path(os.path.realpath(root))
    top = root if sub is None else Path(os.path.realpath(sub))
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            why = _problem(path, root)
            if why is not None:
                raise TaskError(f"{path} {why}: refused (a task may hold only its own files)")


def task_files(root: Path, source: Path) -> list[Path]:
    """The regular files under `source` (a file or a folder of the task at `root`), after check_tree."""
    root = Path(os.path.realpath(root))
    source = Path(source)
    if source.is_symlink() or not source.is_dir():
        why = _problem(source, root)
        if why is not None:
            raise TaskError(f"{source} {why}: refused (a task may hold only its own files)")
        return [source]
    check_tree(root, Path(os.path.realpath(source)))
    return sorted(p for p in source.rglob("*") if p.is_file())


def read_sandbox_file(path: Path, limit: int = MAX_REWARD_BYTES) -> str | None:
    """The text of a file a sandbox wrote, or None when it is absent, not a regular file, or a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit).decode("utf-8", errors="replace")
