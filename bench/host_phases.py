"""Where an engine step's host time goes, without a profiler: wall-clock timers around the scheduler's
phases, for `python -m bench.engine_gpu --host-phases`, and on the CPU `python -m bench.host_phases`
(the host's own work per step, with a forward too small to matter).

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
from pathlib import Path

import miles.engine.scheduler as scheduler_module
from miles.engine.staging import InFlight

SCHEDULER_PHASES = (
    "step", "_land", "_admit", "_retire", "_grow", "_decode", "_to_device",
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
    wrap(sched.decoding, "advance", "_step_ahead")  # the label of earlier records (decode_modes.StepAhead)
    wrap(sched.decoder, "forward", "decoder.forward")  # eager forwards (prefills; decode off the graphs)
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


def cpu_round(requests: int, new_tokens: int) -> dict[str, dict[str, float]]:
    """The host phases of the overlapped loop on the CPU: `requests` sampled requests of `new_tokens`
    each through a one-layer, 32-wide model, so that the forward is small beside the host's own work.
    The CPU runs the forward inside `_launch_decode`; the phases around it are the host's share."""
    import tempfile

    import torch

    from miles.engine.model import Decoder, ModelSpec, load_weights
    from miles.engine.request import Request
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Scheduler
    from miles.models.tiny import init_tiny

    with tempfile.TemporaryDirectory() as tmp:
        path = init_tiny(Path(tmp) / "m", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        decoder = Decoder(ModelSpec.from_dir(path), load_weights(path), "cpu", torch.float32)
    sched = Scheduler(decoder, requests, requests * (new_tokens + 8), overlap=True)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    for i in range(requests):
        sched.submit(Request(str(i), [3, 4, 5, 6 + i % 50], params, i, frozenset()))
    with timed_phases(sched) as totals:
        sched.run_until_idle()
    return per_step(totals)


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description=cpu_round.__doc__)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write every round's phases as JSON here")
    args = p.parse_args()
    rounds = [cpu_round(args.requests, args.new_tokens) for _ in range(args.rounds)]
    for phase in rounds[0]:
        us = sorted(r[phase]["us_per_step"] for r in rounds if phase in r)
        print(f"  {phase:<36}{us[len(us) // 2]:>9.1f} us/step (median; {us[0]:.1f}-{us[-1]:.1f})")
    if args.out:
        Path(args.out).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
