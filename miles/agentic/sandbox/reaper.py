"""Run a command so that everything it starts dies with the process that started this one.

    python -I reaper.py [--uid N] CMD...

A container runtime forks processes that leave the command's process tree (apptainer's runtime
parent, its FUSE mounts), so a parent-death signal on the command alone does not stop a container
whose owner was killed. This program is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): whatever
the command starts stays its descendant. When its parent dies it gets SIGTERM (PR_SET_PDEATHSIG) and
kills every descendant; when the command ends it waits briefly for the rest to finish, kills what
is left, and exits with the command's status. With `--uid N` (when started as root) the command runs
as uid and gid N, and this program, still root, can stop it. Standard library only, run in isolated mode (no site
packages) so it starts in milliseconds; no Miles import.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 2.0
"""How long descendants may outlive the command (a runtime unmounting its image) before being killed."""


def children() -> list[int]:
    pids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return pids


def kill_all() -> None:
    """SIGKILL every descendant: killed processes' children are adopted here, so repeat until none."""
    while kids := children():
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap(block=True)


def reap(block: bool = False) -> dict[int, int]:
    """Wait for ended children; their pids and wait statuses."""
    ended: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block and not ended else os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended[pid] = status


def main(argv: list[str]) -> int:
    uid = None
    if argv[:1] == ["--uid"] and len(argv) > 1:
        uid, argv = int(argv[1]), argv[2:]
    if not argv:
        print("usage: reaper.py [--uid N] CMD...", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    parent = os.getppid()

    def parent_died(*_: object) -> None:
        kill_all()
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, parent_died)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        return 128 + signal.SIGTERM
    command = os.fork()
    if command == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"reaper: cannot run {argv[0]}: {e}", file=sys.stderr)
            os._exit(127)
    status = None
    while status is None:
        status = reap(block=True).get(command)
    deadline = time.monotonic() + GRACE_S
    while children() and time.monotonic() < deadline:
        reap()
        time.sleep(0.01)
    kill_all()
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
