"""Run a command so that everything it starts dies with the process that started this one, or when
this one is killed.

    python -I reaper.py [--uid N] CMD...

A container runtime forks processes that leave the command's process tree (apptainer's runtime
parent and its FUSE mount helper, which holds the image mounted and so never exits by itself once
orphaned), so neither a parent-death signal on the command nor a SIGKILL to its process group stops
all of a container. Two processes of this program do:
- the front stays in the caller's process group, which the caller SIGKILLs at a wall-time limit or
  on close; it has a parent-death signal (SIGKILL) and only relays the guardian's exit status;
- the guardian leaves that group (setsid), is a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so
  whatever the command starts stays its descendant, and gets SIGTERM when the front dies
  (PR_SET_PDEATHSIG): then it kills every descendant and exits. When the command ends by itself it
  waits briefly for the rest, kills what is left and exits with the command's status.
With `--uid N` (started as root) the command runs as uid and gid N, and the guardian, still root, can
stop it. With `--egress "PASTA ARGS"` the guardian waits for a descendant in a network namespace other
than its own (the container's) and runs `PASTA ARGS PID` as the command's user, which connects that
namespace to the node's network (miles/agentic/sandbox/egress.py); pasta stays a descendant, so it
ends with the rest. The command starts in `/`: apptainer fails in a working directory its user cannot open.
Standard library only, run in isolated mode (no site packages) so that it starts in milliseconds; no
Miles import.
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


def exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def descendants(root: int) -> list[int]:
    """Every process below `root` (by /proc's children lists)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(p) for p in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            pass
    return out


def connect(command: int, pasta: list[str], uid: int | None, timeout_s: float = 10.0) -> int | None:
    """Run `pasta PID` for the first descendant of `command` in another network namespace; pasta's
    pid (None when no such namespace appeared)."""
    own = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in descendants(command):
            try:
                if os.readlink(f"/proc/{pid}/ns/net") != own:
                    break
            except OSError:
                continue
        else:
            time.sleep(0.005)
            continue
        if (helper := os.fork()) == 0:
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):  # Python's dispositions
                signal.signal(sig, signal.SIG_DFL)
            quiet = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1):
                os.dup2(quiet, fd)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            try:  # in the foreground: it stays a descendant, and quits when the namespace goes
                os.execvp(pasta[0], [pasta[0], "--foreground", *pasta[1:], str(pid)])
            except OSError as e:
                print(f"reaper: cannot run {pasta[0]}: {e}", file=sys.stderr)
            os._exit(127)
        return helper
    print("reaper: no network namespace to connect appeared", file=sys.stderr)
    return None


def main(argv: list[str]) -> int:
    uid, pasta = None, None
    if argv[:1] == ["--uid"] and len(argv) > 1:
        uid, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--egress"] and len(argv) > 1:
        pasta, argv = argv[1].split(), argv[2:]
    if not argv:
        print("usage: reaper.py [--uid N] CMD...", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the front dies with its caller
    front = os.getpid()
    guardian = os.fork()
    if guardian:  # the front
        _, status = os.waitpid(guardian, 0)
        return exit_code(status)
    os.setsid()
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def front_died(*_: object) -> None:
        kill_all()
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, front_died)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != front:  # the front died before the signal was armed
        front_died()
    command = os.fork()
    if command == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            os.chdir("/")  # the runtime must not depend on our directory, which uid N may not reach
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"reaper: cannot run {argv[0]}: {e}", file=sys.stderr)
        os._exit(127)
    helper = connect(command, pasta, uid) if pasta else None
    status = None
    while status is None:
        status = reap(block=True).get(command)
    if helper is not None:  # pasta serves the command alone: no grace for it
        try:
            os.kill(helper, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    while children() and time.monotonic() < deadline:
        reap()
        time.sleep(0.01)
    kill_all()
    os._exit(exit_code(status))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
