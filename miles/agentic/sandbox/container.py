"""The cluster sandbox backend: per-episode commands in the cluster's container runtime (apptainer or
enroot), rendered from the hardware profile's `container` section.

`container_argv` is a pure function (profile + settings + directory + command -> argv), pinned by
golden files in tests/golden/sandbox/. `ContainerSandbox` runs those command lines with the local
backend's process handling (own directory, wall-time kill, output caps, wipe on close).

What each runtime line does:
- apptainer: `apptainer --silent exec --containall --cleanenv --no-privs --net --network none
  --writable-tmpfs --home DIR:/sandbox --pwd /sandbox IMAGE prlimit ... -- CMD`: its own PID and IPC
  namespaces, a clean environment, the episode's directory as home, no network but loopback,
  an in-memory overlay over the image (writes vanish with the command), nothing of the host bound but
  the episode's directory (the profile's `mounts`, which hold the shared filesystem and so the run
  directory, are deliberately NOT bound).
- enroot: enroot has no network namespace of its own, so the line is `unshare --user
  --map-current-user --net -- enroot start --mount DIR:/sandbox --env HOME=/sandbox NAME prlimit ...
  -- CMD`. The container NAME is made once per node from the profile's image (`enroot create
  --name NAME IMAGE`, see `enroot_create_argv`); without `--rw` its root filesystem stays
  read-only, so episodes never see each other's writes.
Limits are set by `prlimit` inside the image (util-linux, present in Debian-based images), as
locally. The runtime runs as the user Miles runs as (as uid 65534 when Miles runs as root, like the
local backend), under reaper.py, which kills all the runtime forked at a wall-time kill or when its
owner dies. Nodes without registry access run images pulled ahead into `image_dir` (`resolve_image`).

The apptainer lines run in the tests (tests/unit/test_sandbox_apptainer.py and the episode tests of
tests/unit/test_harbor_tasks.py, on hosts with apptainer: containers/apptainer.sh installs it on
Debian 12, CI does); the enroot lines are rendered and checked only (enroot has no Debian package).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from miles.agentic.sandbox.base import Limits, SandboxStartError
from miles.agentic.sandbox.bwrap import INSIDE, BwrapSandbox, BwrapSettings, prlimit_argv, run_as
from miles.agentic.sandbox.egress import egress_missing, pasta_argv
from miles.config.profile import ContainerSandboxConfig, Profile

WAIT_FOR_ROUTE = (
    'i=0; while [ $i -lt 500 ]; do while read -r _ dst _; do [ "$dst" = 00000000 ] && break 2; '
    'done < /proc/net/route; i=$((i+1)); sleep 0.01; done; exec "$@"'
)
"""A command in an egress container waits (up to 5 s) for the route pasta sets up, then runs."""
REAPER = str(Path(__file__).with_name("reaper.py"))
"""Runs each container command so that what the runtime forks dies with its owner (reaper.py)."""


def sandbox_image(profile: Profile | None, cfg: ContainerSandboxConfig) -> str:
    image = cfg.image or (profile.container.image if profile is not None else None)
    if image:
        return image
    if profile is None:
        raise ValueError("no container image for sandboxes: set the sandbox config's `image`")
    raise ValueError(
        f"profile {profile.name!r} has no container image for sandboxes: set container.image in "
        f"profiles/{profile.name}.yaml or the sandbox config's `image`"
    )


def pulled_name(image: str, runtime: str) -> str:
    """The file name the runtime's own pull gives registry image `image`: `apptainer pull` writes
    NAME_TAG.sif (NAME the last path part), `enroot import` PATH+TAG.sqsh (`/` and `:` as `+`)."""
    ref = image.split("://", 1)[-1].split("@", 1)[0].split("#", 1)[-1]
    if runtime == "apptainer":
        name, _, tag = ref.rsplit("/", 1)[-1].partition(":")
        return f"{name}_{tag or 'latest'}.sif"
    return ref.replace("/", "+").replace(":", "+") + ".sqsh"


def resolve_image(image: str, cfg: ContainerSandboxConfig) -> str:
    """`image` as the runtime is given it: with `cfg.image_dir` set, a registry image (docker://)
    becomes the file pulled ahead into that directory, which must exist."""
    if cfg.image_dir is None or not image.startswith("docker://"):
        return image
    path = Path(cfg.image_dir) / pulled_name(image, cfg.runtime)
    if not path.is_file():
        pull = (
            f"apptainer pull {path} {image}"
            if cfg.runtime == "apptainer"
            else f"enroot import -o {path} {image}"
        )
        raise SandboxStartError(
            "no_image", f"image {image} is not in image_dir {cfg.image_dir}: pull it there first ({pull})"
        )
    return str(path)


def enroot_name(image: str) -> str:
    """The enroot container name made from `image` (its file stem, as enroot's own default)."""
    stem = Path(image.split("://")[-1]).name
    return "miles-sandbox-" + stem.removesuffix(".sqsh").replace(":", "+").replace("/", "+")


def enroot_create_argv(profile: Profile | None, cfg: ContainerSandboxConfig) -> list[str]:
    """Once per node before enroot sandboxes start: unpack the image into a named container."""
    image = sandbox_image(profile, cfg)
    return ["enroot", "create", "--force", "--name", enroot_name(image), image]


def container_argv(
    profile: Profile | None,
    cfg: ContainerSandboxConfig,
    workdir: str,
    cmd: list[str],
    limits: Limits,
    binds: tuple[tuple[str, str], ...] = (),
    chdir: str = INSIDE,
    program: str | None = None,
) -> list[str]:
    """The command line running `cmd` in a container with `workdir` at /sandbox (pure); `binds` also
    puts sub-directories of `workdir` at absolute paths inside (Harbor's /app, /tests, /logs),
    `chdir` is the commands' working directory and `program` the runtime's path (default: its name)."""
    program = program or cfg.runtime
    image = sandbox_image(profile, cfg)
    inner = [*prlimit_argv(cfg.prlimit, limits), *cmd]
    bound = [f"{workdir}/{sub}:{dest}" for sub, dest in binds]
    if cfg.runtime == "apptainer":
        # --silent: only errors (its INFO lines would reach every tool output); the episode directory
        # is the home, which also sets HOME
        argv = [program, "--silent", "exec", "--containall", "--cleanenv", "--no-privs"]
        if cfg.network in ("none", "egress"):  # egress: the reaper connects pasta to this namespace
            argv += ["--net", "--network", "none"]
        if cfg.network == "egress":
            inner = ["/bin/sh", "-c", WAIT_FOR_ROUTE, "sh", *inner]
        argv += ["--writable-tmpfs", "--home", f"{workdir}:{INSIDE}"]
        argv += [*(x for m in bound for x in ("--bind", m)), "--pwd", chdir, *cfg.extra_args, image]
        return argv + inner
    if chdir != INSIDE:  # enroot start has no working-directory flag
        inner = ["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", chdir, *inner]
    argv = ["unshare", "--user", "--map-current-user", "--net", "--"] if cfg.network == "none" else []
    mounts = [f"{workdir}:{INSIDE}", *bound]
    argv += [program, "start", *(x for m in mounts for x in ("--mount", m)), "--env", f"HOME={INSIDE}"]
    return argv + [*cfg.extra_args, enroot_name(image)] + inner


class ContainerSandbox(BwrapSandbox):
    """A sandbox whose commands run in the cluster's container runtime (see the module docstring)."""

    def __init__(
        self,
        profile: Profile | None,
        cfg: ContainerSandboxConfig,
        limits: Limits | None = None,
        binds: tuple[tuple[str, str], ...] = (),
        chdir: str = INSIDE,
    ) -> None:
        settings = BwrapSettings(
            root=cfg.root, limits=limits or Limits(), bwrap=cfg.runtime, binds=binds, chdir=chdir
        )
        super().__init__(settings)
        self.profile, self.cfg = profile, cfg

    def _check_runtime(self) -> None:
        if self.cfg.network == "egress" and self.cfg.runtime != "apptainer":
            raise SandboxStartError(
                "no_egress", f"network: egress is built for apptainer, not {self.cfg.runtime}"
            )
        if self.cfg.network == "egress" and (why := egress_missing()):
            raise SandboxStartError("no_egress", f"network: egress: {why}")
        self._runtime = shutil.which(self.cfg.runtime) or ""
        if not self._runtime:
            raise SandboxStartError(f"no_{self.cfg.runtime}", f"{self.cfg.runtime} not found on this node")
        sandbox_image(self.profile, self.cfg)

    def _command(self, workdir: str, cmd: list[str]) -> list[str]:
        s = self.settings
        argv = container_argv(self.profile, self.cfg, workdir, cmd, s.limits, s.binds, s.chdir, self._runtime)
        uid = run_as(s)
        flags = ["--uid", str(uid)] if uid is not None else []
        if self.cfg.network == "egress":
            flags += ["--egress", " ".join(pasta_argv(self.cfg.egress_to_host)[:-1])]
        return [sys.executable, "-I", REAPER, *flags, *argv]

    def _exec_user(self) -> int | None:
        return None  # the reaper starts as us and runs the runtime as run_as(settings)
