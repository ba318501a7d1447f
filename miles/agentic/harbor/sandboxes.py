"""Where a Harbor episode's sandbox comes from: the backend, the task's image, pools that start ahead.

Backends (`backend` option of the `harbor` environment and `miles tasks check --runtime`):
- local (None): bubblewrap with the host's toolchain (miles/agentic/sandbox/bwrap.py); the task's
  Dockerfile is replayed on it (miles/agentic/harbor/episode.py).
- container ({runtime: apptainer | enroot, ...}, miles/agentic/sandbox/container.py's settings): every
  command runs in the task's own image, `docker://` + [environment] docker_image or the Dockerfile's
  FROM, with the episode's /app, /tests, /logs and /solution bound in and no network; the Dockerfile's
  remaining steps are replayed inside it. With `image_dir` set, images come from files pulled there
  ahead (compute nodes without registry access); an image `miles tasks build` made for the task
  there (miles/agentic/harbor/build.py) is used instead, its Dockerfile then not replayed. enroot needs each image unpacked once per node
  (`enroot create`), which `prepare_image` does the first time an image is met in the process.

Network: a task that sets [environment] allow_internet (Harbor's default) runs, on the local backend,
in a network namespace with egress where the node has it (miles/agentic/sandbox/egress.py); a
apptainer backend gives them the same through pasta connected to the container's namespace
(`network: egress`, miles/agentic/sandbox/reaper.py), another container backend what its `network`
says (none, or host: the node's network);
`offline_reason` says why an episode that asked for network has none.

Pools: episodes draw their sandboxes from a SandboxPool (miles/agentic/sandbox/pool.py) per event
loop, backend, image and limits, which keeps `start_ahead` sandboxes created in the background, so an
episode does not wait for a start (a container's start takes far longer than bubblewrap's few
milliseconds). A sandbox still serves one episode only, and is wiped when it ends.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import weakref
from dataclasses import replace

from miles.agentic.harbor.build import built_image
from miles.agentic.harbor.task import Task
from miles.agentic.sandbox.base import Sandbox, SandboxStartError
from miles.agentic.sandbox.bwrap import BwrapSandbox, BwrapSettings
from miles.agentic.sandbox.container import (
    ContainerSandbox,
    ContainerSandboxConfig,
    enroot_create_argv,
    resolve_image,
)
from miles.agentic.sandbox.egress import egress_missing
from miles.agentic.sandbox.pool import SandboxPool

BINDS = (("app", "/app"), ("tests", "/tests"), ("logs", "/logs"), ("solution", "/solution"))
APP = "/app"


INTERNET = ("auto", "off")
"""auto: a task that sets allow_internet (Harbor's default) gets egress where the node has it; off:
no episode gets network. The default is MILES_TASKS_INTERNET's value, else auto (`internet`)."""


def internet(choice: str | None = None) -> str:
    """`choice`, or the node's default (MILES_TASKS_INTERNET, else auto), checked against INTERNET."""
    value = choice if choice is not None else os.environ.get("MILES_TASKS_INTERNET", "auto")
    if value not in INTERNET:
        raise ValueError(f"internet={value!r}: use one of {', '.join(INTERNET)}")
    return value


def offline_reason(
    task: Task, choice: str | None = None, backend: ContainerSandboxConfig | None = None
) -> str:
    """Why `task`'s episodes run without the network its [environment] allow_internet asks for, or ""
    (they have it, or it asks for none)."""
    if not task.config.environment.allow_internet:
        return ""
    if internet(choice) == "off":
        return "internet: off"
    if backend is not None and backend.network in ("host", "egress"):
        return ""
    if backend is not None and backend.runtime != "apptainer":
        return (
            f"the {backend.runtime} backend runs episodes with network: {backend.network} "
            "(network: host gives them the node's)"
        )
    return egress_missing()


def episode_settings(
    task: Task, base: BwrapSettings | None = None, choice: str | None = None
) -> BwrapSettings:
    """The sandbox settings of one of `task`'s episodes: Harbor's directories, /app as working
    directory, limits raised to what [environment] asks for, egress when the task allows the internet
    and the node has it (`choice`: one of INTERNET, default `internet()`)."""
    env = task.config.environment
    base = base or BwrapSettings()
    limits = replace(
        base.limits,
        mem_mb=max(base.limits.mem_mb, env.memory_mb),
        fsize_mb=max(base.limits.fsize_mb, min(env.storage_mb, 1024)),
        cpu_s=max(base.limits.cpu_s, 60),
        nproc=max(base.limits.nproc, 64 * env.cpus),
    )
    network = "egress" if env.allow_internet and not offline_reason(task, choice) else base.network
    return replace(base, binds=BINDS, chdir=APP, limits=limits, network=network)


def task_image(task: Task) -> str:
    """The image a container backend runs `task` in (docker:// unless the name says its source)."""
    image = task.config.environment.docker_image or task.base_image
    if not image:
        raise SandboxStartError(
            "no_image", f"{task.path}: no FROM in environment/Dockerfile and no docker_image"
        )
    return image if "://" in image else f"docker://{image}"


def task_backend(
    task: Task, backend: ContainerSandboxConfig, choice: str | None = None
) -> ContainerSandboxConfig:
    """`backend` with the image `task`'s episodes run in: the one `miles tasks build` made for it in
    `image_dir` (miles/agentic/harbor/build.py), else its registry image (pulled ahead there if set);
    and with egress when the task allows the internet and the node has it (apptainer)."""
    built = built_image(task, backend)
    image = str(built) if built is not None else resolve_image(task_image(task), backend)
    update: dict = {"image": image}
    wants = task.config.environment.allow_internet and backend.network == "none"
    if wants and backend.runtime == "apptainer" and not offline_reason(task, choice, backend):
        update["network"] = "egress"
    return backend.model_copy(update=update)


def make_sandbox(
    task: Task, settings: BwrapSettings, backend: ContainerSandboxConfig | None, choice: str | None = None
) -> Sandbox:
    """A new (not yet created) sandbox for one episode of `task`."""
    if backend is None:
        return BwrapSandbox(settings)
    return ContainerSandbox(
        None, task_backend(task, backend, choice), settings.limits, settings.binds, settings.chdir
    )


_prepared: set[str] = set()


async def prepare_image(task: Task, backend: ContainerSandboxConfig | None) -> None:
    """enroot: unpack the task's image into its named container once per process (apptainer pulls
    and caches images itself; the local backend has none)."""
    if backend is None or backend.runtime != "enroot":
        return
    cfg = task_backend(task, backend)
    if cfg.image in _prepared:
        return
    argv = enroot_create_argv(None, cfg)
    try:
        done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxStartError("enroot_create", f"{' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise SandboxStartError(
            "enroot_create", f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-300:]}"
        )
    _prepared.add(cfg.image)


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, SandboxPool]] = (
    weakref.WeakKeyDictionary()
)


def pool_for(
    task: Task,
    settings: BwrapSettings,
    backend: ContainerSandboxConfig | None,
    start_ahead: int,
    max_live: int,
    choice: str | None = None,
) -> SandboxPool:
    """This event loop's pool of sandboxes for episodes like `task`'s (same backend, image, limits)."""
    cfg = task_backend(task, backend, choice) if backend is not None else None
    key = (cfg.model_dump_json() if cfg is not None else None, settings, start_ahead, max_live)
    pools = _pools.setdefault(asyncio.get_running_loop(), {})
    if key not in pools:
        pools[key] = SandboxPool(
            lambda: make_sandbox(task, settings, backend, choice), max_live=max_live, start_ahead=start_ahead
        )
    return pools[key]
