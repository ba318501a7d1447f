"""Sandbox start-up time of the local bubblewrap backend: p50 and p99 over many starts (target p50 <= 50 ms).

    python -m bench.sandbox_start --starts 200
    python -m bench.sandbox_start --starts 100 --runtime apptainer --image /var/cache/miles-images/debian_bookworm-slim.sif

One start is what an episode waits for before its first tool runs: `create()` (a fresh directory)
plus the first `exec(["true"])` (bwrap builds its namespaces and mounts, prlimit sets the limits,
the command runs and exits), then `close()` (timed apart: it is off the episode's critical path).
With `--runtime apptainer` the same is measured for the container backend (each exec is one
`apptainer exec` of the image, under the reaper). Starts run one after another so that each measures latency, not the host's throughput. On a busy
host the wall times mostly measure waiting for a core, so the CPU time a start costs (this process
plus its children: bwrap, prlimit, the command) is printed too: the start-up an idle core would see
is close to it. A second
pass goes through `SandboxPool` with start-ahead to show what an episode waits for when sandboxes
are started in the background (`acquire()` until the first exec returns).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import time
from collections.abc import Callable

from miles.agentic.sandbox.base import Sandbox
from miles.agentic.sandbox.bwrap import BwrapSandbox, BwrapSettings
from miles.agentic.sandbox.container import ContainerSandbox, ContainerSandboxConfig
from miles.agentic.sandbox.pool import SandboxPool

Factory = Callable[[], Sandbox]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def cold_starts(n: int, make: Factory) -> tuple[list[float], list[float]]:
    starts, closes = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = make()
        await sb.create()
        result = await sb.exec(["true"])
        t1 = time.perf_counter()
        await sb.close()
        starts.append(t1 - t0)
        closes.append(time.perf_counter() - t1)
        assert result.returncode == 0, result
    return starts, closes


async def pooled_starts(n: int, make: Factory, ahead: int) -> list[float]:
    pool = await SandboxPool(make, max_live=ahead + 1, start_ahead=ahead).start()
    waits = []
    for _ in range(n):
        await asyncio.sleep(0.05)  # an episode's own work between sandboxes: time for the pool to refill
        t0 = time.perf_counter()
        async with pool.acquire() as sb:
            await sb.exec(["true"])
            waits.append(time.perf_counter() - t0)
    await pool.close()
    return waits


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=200)
    p.add_argument("--pooled", type=int, default=50, help="episodes through the pool (0: skip)")
    p.add_argument("--root", default="", help="sandbox root (default: the system temp directory)")
    p.add_argument("--runtime", choices=("bwrap", "apptainer"), default="bwrap")
    p.add_argument("--image", help="apptainer: the image (a .sif file or docker:// reference)")
    p.add_argument(
        "--network", choices=("none", "egress"), default="none",
        help="bwrap: egress runs each sandbox in a network namespace of pasta's (miles/agentic/sandbox/egress.py)",
    )  # fmt: skip
    args = p.parse_args()
    if args.runtime == "bwrap":
        settings = BwrapSettings(root=args.root, network=args.network)
        make: Factory = lambda: BwrapSandbox(settings)  # noqa: E731
    else:
        if not args.image:
            p.error("--runtime apptainer needs --image")
        cfg = ContainerSandboxConfig(
            runtime="apptainer", image=args.image, root=args.root or "/tmp/miles-sandbox"
        )
        make = lambda: ContainerSandbox(None, cfg)  # noqa: E731
    asyncio.run(cold_starts(5, make))  # warm the page cache
    cpu0 = _cpu_s()
    starts, closes = asyncio.run(cold_starts(args.starts, make))
    cpu_ms = 1000 * (_cpu_s() - cpu0) / args.starts
    print(f"host: {platform.node()} {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    ms = lambda v: f"{1000 * v:.1f} ms"  # noqa: E731
    print(f"{args.runtime} (network {args.network}): cold start (create + first exec), {args.starts} starts:")
    print(
        f"  p50 {ms(pct(starts, 50))}  p90 {ms(pct(starts, 90))}  p99 {ms(pct(starts, 99))}  max {ms(max(starts))}"
    )
    print(f"  close p50 {ms(pct(closes, 50))}  p99 {ms(pct(closes, 99))}")
    print(f"  CPU time per start and close (this process + children): {cpu_ms:.1f} ms")
    if args.pooled:
        waits = asyncio.run(pooled_starts(args.pooled, make, ahead=2))
        print(f"pooled (start_ahead=2), acquire + first exec, {args.pooled} episodes:")
        print(f"  p50 {ms(pct(waits, 50))}  p99 {ms(pct(waits, 99))}")


if __name__ == "__main__":
    main()
