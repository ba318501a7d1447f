"""Container sandbox command lines (apptainer, enroot) of every shipped profile, pinned by golden files.

Regenerate after an intended change (then review the diff):

    .venv/bin/python tests/unit/test_sandbox_container.py
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "sandbox"
WORKDIR = "/tmp/miles-sandbox/sb-golden"
CMD = ["python3", "-c", "print(6 * 7)"]
RUNTIMES = ("apptainer", "enroot")


def profiles() -> list[str]:
    from miles.config.profile import known_profiles

    return known_profiles()


def render(profile_name: str, runtime: str) -> str:
    """The golden text: the sandbox command line, or the error a user would see."""
    from miles.agentic.sandbox.base import Limits
    from miles.agentic.sandbox.container import ContainerSandboxConfig, container_argv, enroot_create_argv
    from miles.config.profile import load_profile

    profile = load_profile(profile_name)
    cfg = ContainerSandboxConfig(runtime=runtime)
    try:
        lines = [shlex.join(container_argv(profile, cfg, WORKDIR, CMD, Limits()))]
        if runtime == "enroot":
            lines.insert(0, shlex.join(enroot_create_argv(profile, cfg)))
    except ValueError as e:
        lines = [f"ValueError: {e}"]
    return "\n".join(lines) + "\n"


def golden_path(profile: str, runtime: str) -> Path:
    return GOLDEN / f"{profile}__{runtime}.txt"


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("profile", profiles())
def test_command_line_matches_golden(profile, runtime):
    path = golden_path(profile, runtime)
    assert path.exists(), f"no golden file {path}; run `.venv/bin/python {Path(__file__).relative_to(REPO)}`"
    assert render(profile, runtime) == path.read_text()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_isolation_flags_and_no_shared_mounts(runtime):
    from miles.agentic.sandbox.base import Limits
    from miles.agentic.sandbox.container import ContainerSandboxConfig, container_argv
    from miles.config.profile import load_profile

    profile = load_profile("h200")
    argv = container_argv(profile, ContainerSandboxConfig(runtime=runtime), WORKDIR, CMD, Limits(nproc=7))
    assert argv[-len(CMD) :] == CMD and "--nproc=7" in argv
    binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--mount", "--home")]
    assert binds == [f"{WORKDIR}:/sandbox"]  # the profile's mounts (the shared FS, run dirs) stay out
    if runtime == "apptainer":
        assert argv[argv.index("--network") + 1] == "none" and "--containall" in argv
        assert profile.container.image in argv
    else:
        assert argv[:4] == ["unshare", "--user", "--map-current-user", "--net"]
    host = container_argv(
        profile, ContainerSandboxConfig(runtime=runtime, network="host"), WORKDIR, CMD, Limits()
    )
    assert "--network" not in host and "unshare" not in host


def test_missing_image_names_the_key():
    from miles.agentic.sandbox.base import Limits
    from miles.agentic.sandbox.container import ContainerSandboxConfig, container_argv
    from miles.config.profile import load_profile

    with pytest.raises(ValueError, match="container.image in profiles/local.yaml"):
        container_argv(load_profile("local"), ContainerSandboxConfig(), WORKDIR, CMD, Limits())
    with pytest.raises(Exception, match="runtim"):
        ContainerSandboxConfig(runtime="docker")


def test_images_pulled_ahead_are_found_by_the_runtimes_own_names(tmp_path):
    from miles.agentic.sandbox.base import SandboxStartError
    from miles.agentic.sandbox.container import ContainerSandboxConfig, pulled_name, resolve_image

    assert pulled_name("docker://python:3.11-slim", "apptainer") == "python_3.11-slim.sif"
    assert pulled_name("docker://ghcr.io/org/tool", "apptainer") == "tool_latest.sif"
    assert (
        pulled_name("docker://nvcr.io#nvidia/pytorch:24.01-py3", "enroot") == "nvidia+pytorch+24.01-py3.sqsh"
    )
    assert pulled_name("docker://python:3.11-slim", "enroot") == "python+3.11-slim.sqsh"
    (tmp_path / "python_3.11-slim.sif").write_bytes(b"sif")
    cfg = ContainerSandboxConfig(runtime="apptainer", image_dir=str(tmp_path))
    assert resolve_image("docker://python:3.11-slim", cfg) == str(tmp_path / "python_3.11-slim.sif")
    assert resolve_image("/shared/x.sif", cfg) == "/shared/x.sif"  # a file is used as it is
    assert resolve_image("docker://rust:1", ContainerSandboxConfig()) == "docker://rust:1"  # no image_dir
    with pytest.raises(
        SandboxStartError, match=r"not in image_dir .*\(enroot import -o .*/rust\+1\.sqsh docker://rust:1\)"
    ):
        resolve_image("docker://rust:1", cfg.model_copy(update={"runtime": "enroot"}))


def test_missing_runtime_is_a_counted_start_failure():
    import asyncio
    import shutil

    from miles.agentic.sandbox.base import SandboxStartError
    from miles.agentic.sandbox.container import ContainerSandbox, ContainerSandboxConfig
    from miles.config.profile import load_profile

    if shutil.which("apptainer"):
        pytest.skip("apptainer is installed here")
    sb = ContainerSandbox(load_profile("h200"), ContainerSandboxConfig(runtime="apptainer"))
    with pytest.raises(SandboxStartError) as e:
        asyncio.run(sb.create())
    assert e.value.reason == "no_apptainer"


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for old in GOLDEN.glob("*.txt"):
        old.unlink()
    for name in profiles():
        for rt in RUNTIMES:
            golden_path(name, rt).write_text(render(name, rt))
            print(golden_path(name, rt).relative_to(REPO))
