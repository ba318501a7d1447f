"""Where an engine step's host time goes, without a profiler: wall-clock timers around the scheduler's
phases, for `python -m bench.engine_gpu --host-phases`.

torch.profiler and cProfile both inflate what they measure (under torch.profiler a decode-graph
launch showed 541 us of host time; `python -m bench.graph_launch_gpu` measures ~20 us). Here each
phase is one `time.perf_counter` pair around a method of the scheduler (or of its graphs and
staging), so the cost added is about a microsecond per call. Times are inclusive (`_step_ahead`
contains `_launch_decode`, which contains `graphs.run`) and reported per engine step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import miles.engine.scheduler as scheduler_module
from miles.engine.staging import InFlight

SCHEDULER_PHASES = (
    "step", "_step_ahead", "_land", "_admit", "_retire", "_grow", "_decode", "_to_device",
    "_launch_decode", "_sample_on_device", "_record_rows", "_record",
)  # fmt: skip


@contextmanager
def timed_phases(sched):
    """Yield a dict that, on exit, maps each phase to its total seconds and calls ([s, n])."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    patched: list[tuple[object, str, object, bool]] = []  # (owner, name, original, was instance attr)

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                t = totals[label]
                t[0] += time.perf_counter() - start
                t[1] += 1

        patched.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, timed)

    for name in SCHEDULER_PHASES:
        wrap(sched, name, name)
    if sched.graphs is not None:
        wrap(sched.graphs, "run", "graphs.run")
    if sched._staging is not None:
        wrap(sched._staging, "put", "staging.put")
        wrap(sched._staging, "fetch", "staging.fetch")
    wrap(scheduler_module, "sampling_rows", "sampling_rows")
    wrap(InFlight, "read", "InFlight.read (waits for the GPU)")
    out: dict[str, list[float]] = {}
    try:
        yield out
    finally:
        for owner, name, original, own in reversed(patched):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        out.update(totals)


def per_step(totals: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """{phase: {us_per_step, calls_per_step}} over the engine steps timed (the `step` phase's calls)."""
    steps = totals.get("step", [0.0, 0])[1] or 1
    return {
        k: {"us_per_step": 1e6 * s / steps, "calls_per_step": n / steps}
        for k, (s, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])
    }
