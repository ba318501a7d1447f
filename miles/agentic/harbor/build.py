"""`miles tasks build DIR... --image-dir D [--runtime apptainer|enroot]`: each task's image built once
from its Dockerfile, with network at build time, into the runtime's own format in D (an Apptainer SIF,
or an enroot squashfs image), which its episodes then start from; a task that names a prebuilt image
([environment] docker_image) has it pulled into D instead (`apptainer pull`, `enroot import`), under
the name the container backend looks for (miles/agentic/sandbox/container.py's `pulled_name`).

The build: the Dockerfile's FROM image, a file in D (pulled there ahead, or a stand-in built by
containers/stand-in-images.sh where no registry is reachable), unpacked into a directory (`apptainer
sif dump` of its root filesystem, `unsquashfs`); the build context staged at /.miles-context; the
Dockerfile's steps in order (WORKDIR, ENV, COPY/ADD from the context, RUN with the host's network) as
one script run in it by `apptainer exec --writable --no-privs` (apt's privilege drop switched off
for the build: without capabilities it cannot setgroups); ENV kept for the image's environment
(Apptainer's /.singularity.d/env, enroot's /etc/environment); then `apptainer build` packs the
directory into a SIF, or `mksquashfs` into the squashfs image `enroot create` unpacks. (Apptainer's
own %post needs capabilities a container host often withholds.) Root is not needed: without it the
steps run under Apptainer's `--fakeroot` (a user namespace that maps the caller to root, so apt and
pip install as root would), and the base's device nodes are left to the runtime. Needs apptainer and
squashfs-tools (containers/apptainer.sh installs both), for either runtime. Episodes bind their own /app, which would hide
what the build left there: the build keeps a copy of /app at /.miles-app, copied into the episode's
/app when it starts (miles/agentic/harbor/episode.py), where the RUN and COPY steps are then not
replayed. An image is named by its task and a hash of the Dockerfile, the context's files and the
base image's name (`built_name`), so an edit builds anew and an unchanged task is not rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path, PurePosixPath

from miles.agentic.harbor.files import TaskError, task_files
from miles.agentic.harbor.task import Task
from miles.agentic.sandbox.container import ContainerSandboxConfig, pulled_name, resolve_image

SEED = "/.miles-app"
"""Where a built image keeps its /app (module docstring)."""


def image_key(task: Task) -> str:
    """12 hex digits of the Dockerfile, every file of the build context and the base image's name."""
    h = hashlib.sha256(str(task.base_image).encode())
    context = task.environment_dir
    for f in sorted(task_files(task.path, context)):
        h.update(str(f.relative_to(context)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


SUFFIX = {"apptainer": ".sif", "enroot": ".sqsh"}


def built_name(task: Task, runtime: str = "apptainer") -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", task.name)
    return f"miles-task_{name}-{image_key(task)}{SUFFIX[runtime]}"


def built_image(task: Task, backend: ContainerSandboxConfig | None) -> Path | None:
    """The image `miles tasks build` made for `task` in the backend's image_dir, if there is one."""
    if backend is None or backend.image_dir is None or task.config.environment.docker_image:
        return None
    path = Path(backend.image_dir) / built_name(task, backend.runtime)
    return path if path.is_file() else None


def pull_argv(image: str, out: Path, runtime: str) -> list[str]:
    """The runtime's own pull of registry image `image` into the file `out`."""
    if runtime == "apptainer":
        return ["apptainer", "--silent", "pull", "--force", str(out), image]
    return ["enroot", "import", "--output", str(out), image]


def pull_task(task: Task, image_dir: str, runtime: str, timeout_s: float) -> tuple[Path, str]:
    """(the file, "pulled" or "cached") of the prebuilt image a task names ([environment] docker_image)."""
    image = task.config.environment.docker_image or ""
    image = image if "://" in image else f"docker://{image}"
    out = Path(image_dir) / pulled_name(image, runtime)
    if out.is_file():
        return out, "cached"
    part = out.with_name(out.name + ".part")
    _run(pull_argv(image, part, runtime), f"pulling {image}", task, timeout_s)
    part.chmod(0o644)
    part.rename(out)
    return out, "pulled"


def _post(task: Task) -> tuple[list[str], list[str]]:
    """(%post lines, %environment lines) replaying the Dockerfile's steps."""
    cwd, post, env = PurePosixPath("/"), ["set -e", "cd /"], []
    for step in task.steps:
        if step.kind == "workdir":
            cwd = cwd / step.args[0]
            post.append(f"mkdir -p {shlex.quote(str(cwd))} && cd {shlex.quote(str(cwd))}")
        elif step.kind == "env":
            line = f"export {step.args[0]}={shlex.quote(step.args[1])}"
            post.append(line)
            env.append(line)
        elif step.kind == "copy":
            *sources, dest = step.args
            target = str(cwd / dest)
            for src in sources:
                source = f"/.miles-context/{src}"
                if (task.environment_dir / src).is_dir():
                    post.append(
                        f"mkdir -p {shlex.quote(target)} && cp -a {shlex.quote(source)}/. {shlex.quote(target)}/"
                    )
                elif dest.endswith("/") or len(sources) > 1:
                    post.append(
                        f"mkdir -p {shlex.quote(target)} && cp -a {shlex.quote(source)} {shlex.quote(target)}/"
                    )
                else:
                    post.append(
                        f"mkdir -p {shlex.quote(str(PurePosixPath(target).parent))} && cp -a {shlex.quote(source)} {shlex.quote(target)}"
                    )
        elif step.kind == "run":
            post.append(f"bash -c {shlex.quote(step.args[0])}")
    post += [f"rm -rf {SEED}", f"if [ -d /app ]; then cp -a /app {SEED}; fi", "rm -rf /.miles-context"]
    return post, env


def definition(task: Task, base: str) -> str:
    """The build of `task`'s image over the local base image file `base`, as the script run in its
    unpacked root (module docstring), after a header naming the base."""
    post, env = _post(task)
    return (
        "\n".join([f"# miles tasks build: {task.name} from {base}", *post, *(f"# env: {x}" for x in env)])
        + "\n"
    )


def _run(cmd: list[str], what: str, task: Task, timeout_s: float) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TaskError(
            f"{task.path}: {what} ran past {timeout_s:g} s ([environment] build_timeout_sec)"
        ) from None
    except FileNotFoundError:
        raise TaskError(f"{task.path}: {cmd[0]} is not installed (bash containers/apptainer.sh)") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-600:]
        raise TaskError(f"{task.path}: {what} exited {done.returncode}: {tail}")


def sif_squashfs(sif: Path, out: Path, timeout_s: float = 600) -> None:
    """The root filesystem of Apptainer image `sif` (its squashfs partition) written to `out`: the
    squashfs image enroot unpacks, or what `unsquashfs` turns into a directory."""
    listing = subprocess.run(["apptainer", "sif", "list", str(sif)], capture_output=True, text=True)
    fs = next((ln.split("|")[0].strip() for ln in listing.stdout.splitlines() if "FS (Squashfs" in ln), None)
    if fs is None:
        raise ValueError("holds no squashfs root filesystem (apptainer sif list)")
    with out.open("wb") as f:
        done = subprocess.run(["apptainer", "sif", "dump", fs, str(sif)], stdout=f, timeout=timeout_s)
    if done.returncode != 0:
        raise ValueError(f"apptainer sif dump {fs} exited {done.returncode}")


def _unpack(task: Task, base: str, root: Path, limit: float) -> None:
    """The base image's root filesystem into `root` (a directory base is copied)."""
    if Path(base).is_dir():
        shutil.copytree(base, root, symlinks=True)
        return
    if base.endswith(".sqsh"):  # an enroot image: squashfs as it is
        _unsquash(task, Path(base), root, limit)
        return
    squash = root.with_suffix(".sqfs")
    try:
        sif_squashfs(Path(base), squash, limit)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        raise TaskError(f"{task.path}: {base}: {e}") from None
    _unsquash(task, squash, root, limit)
    squash.unlink()


def _unsquash(task: Task, squash: Path, root: Path, limit: float) -> None:
    """A squashfs image into the directory `root`. Without root, the image's device nodes cannot be
    made (unsquashfs exits 2 for them); the runtime provides /dev, so that alone is not a failure."""
    cmd = ["unsquashfs", "-q", "-n", "-d", str(root), str(squash)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TaskError(f"{task.path}: unsquashfs {squash}: {e}") from None
    rootless_ok = done.returncode == 2 and os.geteuid() != 0 and (root / "usr").is_dir()
    if done.returncode != 0 and not rootless_ok:
        tail = (done.stderr or done.stdout).strip()[-600:]
        raise TaskError(f"{task.path}: unsquashfs exited {done.returncode}: {tail}")


def build_task(
    task: Task, image_dir: str, timeout_s: float | None = None, runtime: str = "apptainer"
) -> tuple[Path, str]:
    """(the image, "built", "pulled" or "cached"); TaskError naming the task and why otherwise."""
    limit = timeout_s or task.config.environment.build_timeout_sec
    if task.config.environment.docker_image:
        return pull_task(task, image_dir, runtime, limit)
    out = Path(image_dir) / built_name(task, runtime)
    if out.is_file():
        return out, "cached"
    cfg = ContainerSandboxConfig(runtime=runtime, image_dir=image_dir)
    try:
        base = resolve_image(f"docker://{task.base_image}", cfg)
    except Exception as e:  # SandboxStartError: the base image is not in image_dir
        raise TaskError(f"{task.path}: base image {task.base_image}: {e}") from None
    post, env = _post(task)
    with tempfile.TemporaryDirectory(dir=image_dir, prefix=".build-") as tmp:
        root = Path(tmp) / "root"
        _unpack(task, base, root, limit)
        shutil.copytree(task.environment_dir, root / ".miles-context", symlinks=False)
        apt = root / "etc" / "apt" / "apt.conf.d"
        if apt.is_dir():
            (apt / "00miles-build").write_text('APT::Sandbox::User "root";\n')
        script = steps_argv(root, post, rootless=os.geteuid() != 0, extra=_host_network_settings(root))
        _run(script, "the Dockerfile's steps", task, limit)
        (apt / "00miles-build").unlink(missing_ok=True)
        (root / BUILD_CA.lstrip("/")).unlink(missing_ok=True)
        part = out.with_suffix(".part")
        _pack(task, root, env, part, runtime, limit)
    part.chmod(0o644)  # episodes may run the image as another user
    part.rename(out)
    return out, "built"


def steps_argv(root: Path, post: list[str], rootless: bool, extra: list[str] = ()) -> list[str]:
    """The command running the build's script `post` in the unpacked root filesystem `root`: as root
    with root's rights in it, rootless under Apptainer's fakeroot (the caller mapped to root)."""
    privs = ["--fakeroot", "--no-home"] if rootless else ["--no-privs"]
    return ["apptainer", "--silent", "exec", "--writable", *privs, "--cleanenv", "--containall",
            *extra, "--pwd", "/", str(root), "bash", "-c", "\n".join(post)]  # fmt: skip


BUILD_CA = "/.miles-build-ca.crt"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def _host_network_settings(root: Path) -> list[str]:
    """`apptainer exec` flags giving the build's RUN steps the node's way out: its proxy variables,
    and its CA bundle (copied into the build at BUILD_CA, removed before packing) named by the
    variables pip, requests, curl and OpenSSL read, so that a site's TLS-intercepting proxy that the
    node trusts is trusted by the build too. Neither is kept in the image."""
    flags = [f"--env={k}={os.environ[k]}" for k in PROXY_VARS if os.environ.get(k)]
    bundle = next((Path(os.environ[k]) for k in CA_VARS if os.environ.get(k)), None)
    bundle = bundle or Path("/etc/ssl/certs/ca-certificates.crt")
    if bundle.is_file():
        shutil.copyfile(bundle, root / BUILD_CA.lstrip("/"))
        flags += [f"--env={k}={BUILD_CA}" for k in CA_VARS]
    return flags


def _pack(task: Task, root: Path, env: list[str], out: Path, runtime: str, limit: float) -> None:
    """The built root filesystem, with the Dockerfile's ENV, into the runtime's image file `out`."""
    if runtime == "enroot":
        if env:  # enroot start reads the image's /etc/environment (what `enroot import` writes ENV to)
            with (root / "etc" / "environment").open("a") as f:
                f.write("".join(line.removeprefix("export ") + "\n" for line in env))
        squash = ["mksquashfs", str(root), str(out), "-noappend", "-all-root", "-quiet", "-no-progress"]
        _run(squash, "mksquashfs", task, limit)
        return
    if env:
        envdir = root / ".singularity.d" / "env"
        envdir.mkdir(parents=True, exist_ok=True)
        (envdir / "91-miles-task.sh").write_text("\n".join(env) + "\n")
    _run(["apptainer", "--silent", "build", "--force", str(out), str(root)], "apptainer build", task, limit)
