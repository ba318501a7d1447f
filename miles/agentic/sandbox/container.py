"""The cluster sandbox backend: per-episode commands in the cluster's container runtime (apptainer or
enroot), rendered from the hardware profile's `container` section.

`container_argv` is a pure function (profile + settings + directory + command -> argv), pinned by
golden files in tests/golden/sandbox/. `ContainerSandbox` runs those command lines with the local
backend's process handling (own directory, wall-time kill, output caps, wipe on close).

What each runtime line does:
- apptainer: `apptainer exec --containall --no-home --cleanenv --no-privs --net --network none
  --writable-tmpfs --bind DIR:/sandbox --pwd /sandbox IMAGE prlimit ... -- CMD`: its own PID and IPC
  namespaces, a clean environment, no home, no network but loopback, nothing of the host bound but
  the episode's directory (the profile's `mounts`, which hold the shared filesystem and so the run
  directory, are deliberately NOT bound).
- enroot: enroot has no network namespace of its own, so the line is `unshare --user
  --map-current-user --net -- enroot start --mount DIR:/sandbox --env HOME=/sandbox NAME prlimit ...
  -- CMD`. The container NAME is made once per node from the profile's image (`enroot create
  --name NAME IMAGE`, see `enroot_create_argv`); without `--rw` its root filesystem stays
  read-only, so episodes never see each other's writes.
Limits are set by `prlimit` inside the image (util-linux, present in the Miles images), as locally.
These lines are rendered and checked here; they have not run on a cluster from this repository's
tests (no apptainer or enroot on the CI hosts).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from miles.agentic.sandbox.base import Limits, SandboxStartError
from miles.agentic.sandbox.bwrap import INSIDE, BwrapSandbox, BwrapSettings, prlimit_argv
from miles.config.profile import ContainerSandboxConfig, Profile


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
) -> list[str]:
    """The command line running `cmd` in a container with `workdir` at /sandbox (pure); `binds` also
    puts sub-directories of `workdir` at absolute paths inside (Harbor's /app, /tests, /logs) and
    `chdir` is the commands' working directory."""
    image = sandbox_image(profile, cfg)
    inner = [*prlimit_argv(cfg.prlimit, limits), *cmd]
    mounts = [f"{workdir}:{INSIDE}", *(f"{workdir}/{sub}:{dest}" for sub, dest in binds)]
    if cfg.runtime == "apptainer":
        argv = ["apptainer", "exec", "--containall", "--no-home", "--cleanenv", "--no-privs"]
        if cfg.network == "none":
            argv += ["--net", "--network", "none"]
        argv += ["--writable-tmpfs", *(x for m in mounts for x in ("--bind", m)), "--pwd", chdir]
        argv += ["--env", f"HOME={INSIDE}", *cfg.extra_args, image]
        return argv + inner
    if chdir != INSIDE:  # enroot start has no working-directory flag
        inner = ["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", chdir, *inner]
    argv = ["unshare", "--user", "--map-current-user", "--net", "--"] if cfg.network == "none" else []
    argv += ["enroot", "start", *(x for m in mounts for x in ("--mount", m)), "--env", f"HOME={INSIDE}"]
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
        if shutil.which(self.cfg.runtime) is None:
            raise SandboxStartError(f"no_{self.cfg.runtime}", f"{self.cfg.runtime} not found on this node")
        sandbox_image(self.profile, self.cfg)

    def _command(self, workdir: str, cmd: list[str]) -> list[str]:
        s = self.settings
        return container_argv(self.profile, self.cfg, workdir, cmd, s.limits, s.binds, s.chdir)
