"""`miles tasks build`: a task's image built from its Dockerfile with Apptainer, network at build time
(its RUN installs a Debian package, which an episode's replay without network cannot), cached by the
content hash, then used by `miles tasks check --runtime apptainer --image-dir`: the oracle scores 1
and the do-nothing agent 0, where without the built image the same task is refused (its RUN cannot
run offline)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from miles.agentic.harbor.build import built_name, definition, sif_squashfs
from miles.agentic.harbor.task import load_task

DOCKERFILE = """FROM debian:bookworm-slim
WORKDIR /app
COPY data.txt ./data.txt
ENV GREETING=built
RUN --network=host apt-get update -q && apt-get install -y -q --no-install-recommends jq && rm -rf /var/lib/apt/lists/*
RUN echo "$GREETING" > /app/marker
"""
TEST_SH = """mkdir -p /logs/verifier
if [ "$(jq -r .answer /app/answer.json 2>/dev/null)" = "$(cat /app/data.txt)" ] && [ "$(cat /app/marker)" = built ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def build_task_dir(root: Path) -> Path:
    files = {
        "task.toml": 'version = "1.0"\n[verifier]\ntimeout_sec = 60\n[environment]\nbuild_timeout_sec = 600\n',
        "instruction.md": 'Write the number in /app/data.txt as {"answer": "N"} to /app/answer.json.\n',
        "environment/Dockerfile": DOCKERFILE,
        "environment/data.txt": "42\n",
        "tests/test.sh": TEST_SH,
        "solution/solve.sh": 'printf \'{"answer": "%s"}\' "$(cat /app/data.txt)" > /app/answer.json\n',
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_definition_replays_the_dockerfile_in_order(tmp_path) -> None:
    task = load_task(build_task_dir(tmp_path / "jq-task"))
    post = definition(task, "/images/debian_bookworm-slim.sif")
    assert "from /images/debian_bookworm-slim.sif" in post and "/.miles-context" in post
    order = ["mkdir -p /app && cd /app", "cp -a /.miles-context/data.txt /app/data.txt", "export GREETING=built",
             "apt-get install", "/app/marker", "cp -a /app /.miles-app"]  # fmt: skip
    assert [post.index(x) for x in order] == sorted(post.index(x) for x in order)
    assert "--network=host" not in post  # a BuildKit flag, not part of the command
    before = built_name(task)
    (tmp_path / "jq-task" / "environment" / "data.txt").write_text("43\n")
    assert built_name(load_task(tmp_path / "jq-task")) != before  # the context's content names the image


@pytest.mark.slow
def test_a_built_image_serves_the_episodes(tmp_path, apptainer_images) -> None:
    if os.geteuid() != 0:
        pytest.skip("this build test runs as root (as CI does); the rootless build has its own test")
    # an image directory the sandbox's user can read (pytest's tmp_path is root's alone)
    images = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="miles-build-test-"))
    try:
        images.chmod(0o755)
        (images / "debian_bookworm-slim.sif").symlink_to(Path(apptainer_images) / "debian_bookworm-slim.sif")
        _build_and_check(tmp_path / "tasks", images)
    finally:
        shutil.rmtree(images, ignore_errors=True)


def _build_and_check(tasks: Path, images: Path) -> None:
    build_task_dir(tasks / "jq-task")
    check = [sys.executable, "-m", "miles", "tasks", "check", str(tasks), "--runtime", "apptainer",
             "--image-dir", str(images)]  # fmt: skip
    before = subprocess.run(check, capture_output=True, text=True, timeout=300)
    assert before.returncode == 1 and "RUN" in before.stdout and "failed here" in before.stdout, before.stdout
    build = [sys.executable, "-m", "miles", "tasks", "build", str(tasks), "--image-dir", str(images)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "jq-task: built" in done.stdout, done.stdout + done.stderr
    again = subprocess.run(build, capture_output=True, text=True, timeout=120)
    assert "jq-task: cached" in again.stdout
    after = subprocess.run(check, capture_output=True, text=True, timeout=300)
    assert after.returncode == 0 and "1/1 tasks passed" in after.stdout, after.stdout + after.stderr


@pytest.mark.slow
def test_an_enroot_build_is_a_squashfs_with_the_steps_and_env(tmp_path, apptainer_images) -> None:
    """`--runtime enroot`: the same build packed as the squashfs image `enroot create` unpacks, the
    Dockerfile's ENV in its /etc/environment (where enroot reads an image's environment)."""
    if os.geteuid() != 0 or shutil.which("mksquashfs") is None:
        pytest.skip("runs as root with squashfs-tools (as CI does); the rootless build has its own test")
    images = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="miles-build-test-"))
    try:
        root = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="miles-unpack-"))
        shutil.rmtree(root)
        # the base as enroot names a pulled image (NAME+TAG.sqsh): the stand-in's squashfs itself
        sif_squashfs(
            Path(apptainer_images) / "debian_bookworm-slim.sif", images / "debian+bookworm-slim.sqsh"
        )
        build_task_dir(tmp_path / "tasks" / "jq-task")
        cmd = [sys.executable, "-m", "miles", "tasks", "build", str(tmp_path / "tasks"), "--image-dir", str(images),
               "--runtime", "enroot"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0 and "jq-task: built" in done.stdout, done.stdout + done.stderr
        sqsh = images / built_name(load_task(tmp_path / "tasks" / "jq-task"), "enroot")
        assert sqsh.suffix == ".sqsh" and sqsh.is_file()
        subprocess.run(
            ["unsquashfs", "-q", "-n", "-d", str(root), str(sqsh)], check=True, capture_output=True
        )
        assert (root / "usr" / "bin" / "jq").is_file() and (root / "app" / "marker").read_text() == "built\n"
        assert "GREETING=built\n" in (root / "etc" / "environment").read_text()
        assert (root / ".miles-app" / "data.txt").read_text() == "42\n"
    finally:
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def test_a_task_naming_a_prebuilt_image_is_pulled_not_built(tmp_path, apptainer_images) -> None:
    """[environment] docker_image: `miles tasks build` pulls it into the image directory under the name
    the container backend looks for (already there: cached), and a failed pull is the task's row, exit 1.
    The pull goes through a proxy on this host's loopback that refuses, so nothing leaves the machine."""
    from miles.agentic.harbor.build import pull_argv

    task = tmp_path / "tasks" / "prebuilt"
    files = {
        "task.toml": 'version = "1.0"\n[verifier]\ntimeout_sec = 30\n[environment]\ndocker_image = "example.org/team/runner:1.2"\n',
        "instruction.md": "Create /app/done.\n",
        "tests/test.sh": "mkdir -p /logs/verifier; [ -f /app/done ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "touch /app/done\n",
    }
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    images = tmp_path / "images"
    images.mkdir()
    assert pull_argv("docker://x/y:1", images / "y_1.sif", "apptainer")[-2:] == [
        str(images / "y_1.sif"),
        "docker://x/y:1",
    ]
    assert pull_argv("docker://x/y:1", images / "x+y+1.sqsh", "enroot")[:3] == [
        "enroot",
        "import",
        "--output",
    ]
    build = [sys.executable, "-m", "miles", "tasks", "build", str(task.parent), "--image-dir", str(images)]
    env = {
        **os.environ,
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "",
    }
    failed = subprocess.run(build, capture_output=True, text=True, timeout=300, env=env)
    assert failed.returncode == 1 and "prebuilt: error:" in failed.stdout, failed.stdout + failed.stderr
    assert "pulling docker://example.org/team/runner:1.2" in failed.stdout
    (images / "runner_1.2.sif").symlink_to(Path(apptainer_images) / "debian_bookworm-slim.sif")
    cached = subprocess.run(build, capture_output=True, text=True, timeout=60, env=env)
    assert cached.returncode == 0 and f"prebuilt: cached {images / 'runner_1.2.sif'}" in cached.stdout


@pytest.mark.slow
def test_the_build_runs_rootless_under_fakeroot(tmp_path, apptainer_images) -> None:
    """Without root, a build's steps run under Apptainer's fakeroot: an unprivileged user (65534 here)
    unpacks the base, installs a Debian package with apt-get as the Dockerfile's RUN does, and packs
    the image; the package is in it."""
    from miles.agentic.harbor.build import _post, sif_squashfs, steps_argv

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("runs the rootless build as another user: needs root to switch to it")
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="miles-rootless-"))
    try:
        os.chown(work, 65534, 65534)
        as_user = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
        env = {"PATH": os.environ["PATH"], "HOME": str(work)}
        sif_squashfs(Path(apptainer_images) / "debian_bookworm-slim.sif", work / "base.sqfs")
        os.chown(work / "base.sqfs", 65534, 65534)
        unpack = subprocess.run([*as_user, "unsquashfs", "-q", "-n", "-d", str(work / "root"), str(work / "base.sqfs")],
                                capture_output=True, text=True, env=env)  # fmt: skip
        assert unpack.returncode in (0, 2) and (work / "root" / "usr").is_dir(), unpack.stderr[-500:]
        (work / "root" / "etc" / "apt" / "apt.conf.d" / "00miles-build").write_text(
            'APT::Sandbox::User "root";\n'
        )
        task = load_task(build_task_dir(tmp_path / "jq-task"))
        post = [line for line in _post(task)[0] if "miles-context" not in line]  # no context staged here
        run = subprocess.run([*as_user, *steps_argv(work / "root", post, rootless=True)],
                             capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
        assert run.returncode == 0, (run.stdout + run.stderr)[-800:]
        assert (work / "root" / "usr" / "bin" / "jq").is_file() and (
            work / "root" / "app" / "marker"
        ).is_file()
        pack = subprocess.run([*as_user, "apptainer", "--silent", "build", str(work / "out.sif"), str(work / "root")],
                              capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
        assert pack.returncode == 0 and (work / "out.sif").stat().st_uid == 65534, pack.stderr[-500:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
