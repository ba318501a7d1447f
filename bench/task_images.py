"""Harbor tasks written elsewhere (tests/foreign_tasks): image build time per runtime format, and
episode start-up per backend, p50 / p99.

    python -m bench.task_images --images /var/cache/miles-images --episodes 30
    python -m bench.task_images --built DIR --episodes 20   # start-up only, from images built in DIR

Build: `miles tasks build`'s build_task for each task the fixture can build (multi-step,
tb2-log-summary, and tb1-count-errors after `miles tasks convert`), into a fresh image directory,
once as Apptainer SIF and once as enroot squashfs (the same RUN steps; apt and pip download from
their mirrors, so the time includes the network), then again (cached: the content hash found).
Episode start-up: what an episode waits for before its first tool runs, `Episode.start()` (a fresh
sandbox, /app seeded from the built image or the Dockerfile replayed) plus a first `bash true`,
one episode after another, for the converted Terminal-Bench 1 task on the local backend (bubblewrap,
Dockerfile replayed; network none, then egress through pasta) and on apptainer from its built SIF
(network none, then egress: pasta attached to the container's namespace).
Needs root, apptainer, squashfs-tools and the stand-in base images (containers/stand-in-images.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from bench.sandbox_start import pct
from miles.agentic.harbor.build import build_task, sif_squashfs
from miles.agentic.harbor.convert import convert_paths
from miles.agentic.harbor.episode import Episode
from miles.agentic.harbor.task import load_task
from miles.agentic.sandbox.bwrap import BwrapSettings
from miles.agentic.sandbox.container import ContainerSandboxConfig, pulled_name

FOREIGN = Path(__file__).resolve().parents[1] / "tests" / "foreign_tasks"
BUILDABLE = ("multi-step", "tb2-log-summary", "tb1-count-errors")


def _tasks(work: Path) -> dict[str, Path]:
    tasks = work / "tasks"
    for name in BUILDABLE[:2]:
        shutil.copytree(FOREIGN / name, tasks / name)
    convert_paths([str(FOREIGN / "tb1-count-errors")], str(tasks))
    return {name: tasks / name for name in BUILDABLE}


def builds(tasks: dict[str, Path], base_images: Path, work: Path) -> None:
    for runtime in ("apptainer", "enroot"):
        images = work / f"images-{runtime}"
        images.mkdir(mode=0o755)
        for f in base_images.glob("*.sif"):
            (images / f.name).symlink_to(f.resolve())
        for name, path in tasks.items():
            if runtime == "enroot":  # enroot's base image: the stand-in SIF's own squashfs
                ref = f"docker://{load_task(path).base_image}"
                sif = base_images / pulled_name(ref, "apptainer")
                sif_squashfs(sif.resolve(), images / pulled_name(ref, "enroot"))
            t0 = time.perf_counter()
            out, how = build_task(load_task(path), str(images), runtime=runtime)
            built = time.perf_counter() - t0
            t0 = time.perf_counter()
            _, again = build_task(load_task(path), str(images), runtime=runtime)
            cached = time.perf_counter() - t0
            size = out.stat().st_size / 2**20
            print(
                f"  {runtime:9s} {name:18s} {how} in {built:6.1f} s ({size:.0f} MiB), then {again} in {1000 * cached:.0f} ms"
            )


async def _episode_starts(task_dir: Path, n: int, **kwargs) -> list[float]:
    task, waits = load_task(task_dir), []
    for _ in range(n):
        t0 = time.perf_counter()
        async with Episode(task, **kwargs) as ep:
            await ep.bash("true")
            waits.append(time.perf_counter() - t0)
    return waits


def starts(tasks: dict[str, Path], work: Path, n: int) -> None:
    tb1 = tasks["tb1-count-errors"]
    cases = {
        "local, network none": {"internet": "off"},
        "local, egress (pasta)": {"internet": "auto", "settings": BwrapSettings()},
        "apptainer, built SIF": {"internet": "off",
                                 "backend": ContainerSandboxConfig(runtime="apptainer", image_dir=str(work / "images-apptainer"))},
        "apptainer, egress (pasta)": {"internet": "auto",
                                      "backend": ContainerSandboxConfig(runtime="apptainer", image_dir=str(work / "images-apptainer"))},
    }  # fmt: skip
    for label, kwargs in cases.items():
        asyncio.run(_episode_starts(tb1, 2, **kwargs))  # warm the page cache
        waits = asyncio.run(_episode_starts(tb1, n, **kwargs))
        ms = lambda v: f"{1000 * v:.0f} ms"  # noqa: E731
        print(
            f"  {label:24s} p50 {ms(pct(waits, 50))}  p99 {ms(pct(waits, 99))}  max {ms(max(waits))}  ({n} episodes)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", default="/var/cache/miles-images", help="the stand-in base images")
    p.add_argument("--episodes", type=int, default=30)
    p.add_argument(
        "--built", help="skip the builds: Apptainer images `miles tasks build` made in this directory"
    )
    args = p.parse_args()
    print(f"host: {platform.node()} {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="miles-bench-images-"))
    try:
        work.chmod(0o755)
        tasks = _tasks(work)
        if args.built:
            (work / "images-apptainer").symlink_to(Path(args.built).resolve())
        else:
            print("build (fresh image directory; network at build time), then the same build again:")
            builds(tasks, Path(args.images), work)
        print("episode start-up of tb1-count-errors (Episode.start + first bash), one after another:")
        starts(tasks, work, args.episodes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
