"""The local sandbox backend: every command runs under bubblewrap in the episode's own directory.

Isolation (all from `bwrap`, version 0.8 or later, no daemon, no root needed):
- filesystem: a new mount namespace holding only read-only binds of the system (`/usr`, `/etc` and
  the `/bin`, `/lib*`, `/sbin` links or binds), a fresh `/proc`, `/dev` and `/tmp`, and the
  sandbox's own directory (created under `settings.root`, never under the run directory) read-write
  at `/sandbox`. Nothing else of the host, the run directory included, is visible.
- network: `--unshare-net`, so only a down loopback exists inside (no host loopback services);
  `network: egress` runs bwrap in a network namespace of pasta's instead, with a route out and its
  own loopback (miles/agentic/sandbox/egress.py).
- processes: new PID, IPC, UTS and user namespaces, `--die-with-parent`, and bwrap itself started
  with a parent-death signal (`setpriv --pdeathsig KILL`); when Miles runs as root
  the command runs as the unprivileged `settings.uid` (65534) so that process limits hold.
- limits: `prlimit` (util-linux) inside the namespaces sets CPU time, address space, processes,
  file size and open files; wall time is enforced here, killing bwrap's process group, whose
  death (`--die-with-parent` + PID namespace) takes every process of the sandbox with it.
Start-up is one `bwrap` exec (tens of ms); `bench/sandbox_start.py` measures it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from miles.agentic.sandbox import process
from miles.agentic.sandbox.base import ExecResult, Limits, SandboxError, SandboxStartError
from miles.agentic.sandbox.egress import egress_missing, pasta_argv
from miles.processes import pid_alive

CLOSE_WAIT_S = 5.0
"""How long close() waits for killed processes to disappear before wiping anyway."""
INSIDE = "/sandbox"
"""Where the sandbox's directory appears inside."""
_SYSTEM_DIRS = ("/usr", "/etc")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


@dataclass(frozen=True)
class BwrapSettings:
    """How local sandboxes are made."""

    root: str = ""
    """Directory holding the per-episode directories (default: <system temp>/miles-sandbox-<uid>)."""
    limits: Limits = field(default_factory=Limits)
    uid: int | None = None
    """Unprivileged uid (and gid) commands run as when Miles runs as root (None: 65534)."""
    forbidden: tuple[str, ...] = ()
    """Directories `root` must not lie in (the run directory); checked at create."""
    bwrap: str = "bwrap"
    prlimit: str = "/usr/bin/prlimit"
    """prlimit as seen inside the sandbox (util-linux)."""
    setpriv: str = "/usr/bin/setpriv"
    """setpriv (util-linux) giving bwrap a parent-death signal, so that a Miles process killed with
    SIGKILL takes its sandboxes with it (skipped when absent)."""
    system_dirs: tuple[str, ...] = _SYSTEM_DIRS
    """Host directories bound read-only at the same path."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables of every command (the host environment is never passed)."""
    binds: tuple[tuple[str, str], ...] = ()
    """Sub-directories of the episode directory bound read-write at absolute paths inside, e.g.
    (("app", "/app"), ("logs", "/logs")) for Harbor tasks; created empty with the sandbox."""
    chdir: str = INSIDE
    """Working directory of every command."""
    network: str = "none"
    """none: a loopback only; egress: a route out through pasta (miles/agentic/sandbox/egress.py)."""
    egress_to_host: bool = False
    """With egress, the gateway's address reaches the host's loopback (tests only: egress.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.limits, dict):
            object.__setattr__(self, "limits", Limits(**self.limits))


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / f"miles-sandbox-{os.getuid()}"


def run_as(settings: BwrapSettings) -> int | None:
    """The uid commands run as: `settings.uid` (default 65534) when we are root, else None (ourselves)."""
    if os.getuid() != 0:
        return None
    return 65534 if settings.uid is None else settings.uid


def bwrap_argv(settings: BwrapSettings, workdir: str, cmd: list[str]) -> list[str]:
    """The full command line running `cmd` in the sandbox whose directory is `workdir` (reads only
    which of the host's /bin, /lib* are links)."""
    net = ["--unshare-net"] if settings.network != "egress" else []  # egress: pasta's namespace
    argv = [settings.bwrap, "--unshare-user", "--unshare-pid", *net, "--unshare-ipc"]
    # no --new-session: the runner already starts bwrap in a session of its own (no controlling
    # terminal), and keeping the sandbox in bwrap's process group lets one killpg stop all of it
    argv += ["--unshare-uts", "--unshare-cgroup-try", "--die-with-parent"]
    for d in settings.system_dirs:
        argv += ["--ro-bind", d, d]
    for link in _SYSTEM_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", workdir, INSIDE]
    for sub, target in settings.binds:
        argv += ["--bind", os.path.join(workdir, sub), target]
    argv += ["--remount-ro", "/"]
    argv += ["--chdir", settings.chdir, "--clearenv", "--hostname", "sandbox"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": INSIDE, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    env.update(dict(settings.env))
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv + ["--", *prlimit_argv(settings.prlimit, settings.limits), *cmd]


def prlimit_argv(prlimit: str, lim: Limits) -> list[str]:
    """`prlimit` setting every limit of `lim` on the command that follows (wall time excepted)."""
    return [
        prlimit,
        f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}",
        f"--as={lim.mem_mb << 20}",
        f"--nproc={lim.nproc}",
        f"--fsize={lim.fsize_mb << 20}",
        f"--nofile={lim.nofile}",
        "--core=0",
        "--",
    ]


def _wipe(path: str, pgids: set[int]) -> None:
    """Kill what still runs and remove the directory (close() and the finalizer both end here)."""
    for pgid in list(pgids):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    pgids.clear()
    shutil.rmtree(path, ignore_errors=True)


class BwrapSandbox:
    """A bubblewrap sandbox; see the module docstring and `miles.agentic.sandbox.base.Sandbox`."""

    def __init__(self, settings: BwrapSettings | None = None) -> None:
        self.settings = settings or BwrapSettings()
        self.path: Path | None = None
        self.closed = False
        self._pgids: set[int] = set()
        """Process groups that may be signalled (from start until just before their leader is reaped)."""
        self._groups: set[int] = set()
        """Every process group this sandbox started; close() waits until they are empty."""
        self._spawning: set[object] = set()
        """One token per exec whose process is being started and not yet registered (`_started`)."""
        self._runtime = ""
        self._finalizer: weakref.finalize | None = None

    async def __aenter__(self) -> BwrapSandbox:
        await self.create()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create(self) -> None:
        if self.path is not None or self.closed:
            raise SandboxError("a sandbox is created once; make a new one per episode")
        root = Path(self.settings.root or default_root()).resolve()
        for bad in self.settings.forbidden:
            if root == Path(bad).resolve() or Path(bad).resolve() in root.parents:
                raise SandboxStartError(
                    "root_in_run_dir", f"sandbox root {root} lies in {bad}; pick another root"
                )
        self._check_runtime()
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o711)
            sweep_orphans(root)
            path = tempfile.mkdtemp(prefix=f"{owner_prefix()}-", dir=root)
            uid = run_as(self.settings)
            if uid is not None:
                os.chown(path, uid, uid)
                _check_searchable(Path(path), uid)
        except OSError as e:
            raise SandboxStartError("workdir", str(e)) from e
        self.path = Path(path)
        self._finalizer = weakref.finalize(self, _wipe, path, self._pgids)
        for sub, _ in self.settings.binds:
            await self.make_dir(sub)

    async def make_dir(self, path: str) -> None:
        """An (empty, if new) directory at `path`, owned by the uid commands run as."""
        target = self._inside(path)
        target.mkdir(parents=True, exist_ok=True)
        self._chown_up(target)

    def _chown_up(self, target: Path) -> None:
        uid = run_as(self.settings)
        if uid is not None:
            for p in [target, *[q for q in target.parents if self._live() in q.parents]]:
                os.chown(p, uid, uid)

    async def exec(
        self, cmd: str | list[str], timeout_s: float | None = None, stdin: bytes | str | None = None
    ) -> ExecResult:
        workdir = self._live()
        argv = self._command(str(workdir), ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        lim = self.settings.limits
        token = object()

        def started(pid: int) -> None:
            self._started(pid)
            self._spawning.discard(token)  # after registering: close() then sees the group

        self._spawning.add(token)
        try:
            done = await process.run_in_thread(
                argv,
                data,
                lim.wall_s if timeout_s is None else timeout_s,
                lim.output_bytes,
                started,
                self._pgids.discard,
                self._exec_user(),
            )
        except OSError as e:
            raise SandboxStartError("bwrap_exec", str(e)) from e
        finally:
            self._spawning.discard(token)
        stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        reason = "wall_time" if done.timed_out else _reason(done.returncode, stderr)
        return ExecResult(done.returncode, stdout, stderr, done.timed_out, reason)

    def _started(self, pid: int) -> None:
        """Called from the exec thread: register the process group, or stop it if the sandbox closed."""
        self._pgids.add(pid)
        self._groups.add(pid)
        if self.closed:
            process.kill_group(pid)

    def _exec_user(self) -> int | None:
        """The uid the isolating program is started as (None: ours)."""
        return run_as(self.settings)

    def _check_runtime(self) -> None:
        """Raise SandboxStartError when the program that isolates commands is missing."""
        self._runtime = shutil.which(self.settings.bwrap) or ""
        if not self._runtime:
            raise SandboxStartError("no_bwrap", f"{self.settings.bwrap} not found: install bubblewrap")
        if self.settings.network == "egress" and (why := egress_missing()):
            raise SandboxStartError("no_egress", f"network: egress: {why}")

    def _command(self, workdir: str, cmd: list[str]) -> list[str]:
        """The argv running `cmd` isolated in `workdir` (other backends override this and the check)."""
        argv = [self._runtime, *bwrap_argv(self.settings, workdir, cmd)[1:]]
        if self.settings.network == "egress":
            argv = [*pasta_argv(self.settings.egress_to_host), *argv]
        if os.path.exists(self.settings.setpriv):
            argv = [self.settings.setpriv, "--pdeathsig", "KILL", "--", *argv]
        return argv

    async def write_file(self, path: str, data: bytes | str) -> None:
        target = self._inside(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)
        self._chown_up(target)

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        target = self._inside(path)
        if not target.is_file():
            raise SandboxError(f"no file {path!r} in the sandbox")
        with open(target, "rb") as f:
            return f.read(max_bytes)

    async def close(self) -> None:
        """Kill every command (one being started is waited for until its process group is known), wait
        (up to CLOSE_WAIT_S) until their processes are gone, wipe."""
        self.closed = True
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._spawning and time.monotonic() < deadline:  # a command being started registers first
            await asyncio.sleep(0.005)
        for pgid in list(self._pgids):
            process.kill_group(pgid)
        while any(process.group_alive(g) for g in self._groups) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._finalizer is not None:
            self._finalizer()  # runs _wipe once; later calls are no-ops

    def _live(self) -> Path:
        if self.closed or self.path is None:
            raise SandboxError("the sandbox is closed" if self.closed else "create() the sandbox first")
        return self.path

    def _inside(self, path: str) -> Path:
        base = self._live()
        rel = path[len(INSIDE) + 1 :] if path.startswith(INSIDE + "/") else path
        for sub, target in self.settings.binds:  # a path under a bind target lives in its sub-directory
            if path == target or path.startswith(target + "/"):
                rel = sub + path[len(target) :]
        target = Path(os.path.realpath(base / rel))
        if target != base and base not in target.parents:
            raise SandboxError(f"path {path!r} leaves the sandbox directory")
        return target


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "0"


def owner_prefix(pid: int | None = None) -> str:
    """The start of the names of the episode directories process `pid` (default: this one) creates:
    its PID namespace and pid, so that a later process can tell whose they are."""
    return f"sb-{_pid_namespace()}-{os.getpid() if pid is None else pid}"


_swept: set[Path] = set()


def sweep_orphans(root: Path) -> list[str]:
    """Remove the episode directories under `root` whose creator is gone (a Miles process killed
    with SIGKILL leaves them: nothing was left to wipe them), once per root and process. Only
    directories of processes of this PID namespace are touched, and only when that pid is free."""
    if root in _swept:
        return []
    _swept.add(root)
    ns = f"sb-{_pid_namespace()}-"
    removed = []
    for entry in os.scandir(root):
        pid = entry.name[len(ns) :].split("-", 1)[0]
        if not entry.name.startswith(ns) or not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _check_searchable(path: Path, uid: int) -> None:
    """bwrap runs as `uid` and must reach `path`: every directory above it must be searchable by it."""
    for parent in path.parents:
        st = parent.stat()
        if st.st_uid != uid and not st.st_mode & 0o001:
            shutil.rmtree(path, ignore_errors=True)
            raise SandboxStartError(
                "root_not_searchable",
                f"{parent} is not searchable by uid {uid} (the sandbox user); put the sandbox root "
                "under a world-searchable directory such as the system temp directory",
            )


def _reason(rc: int, stderr: str) -> str | None:
    """Why a command died, from its exit status and stderr (rlimits give no other trace)."""
    if rc == 128 + signal.SIGXCPU or rc == 128 + signal.SIGKILL and "cpu" in stderr.lower():
        return "cpu_time"
    if rc == 128 + signal.SIGXFSZ:
        return "file_size"
    if rc != 0 and any(m in stderr for m in _MEMORY_MARKERS):
        return "memory"
    if rc > 128:
        return "signal"
    return None
