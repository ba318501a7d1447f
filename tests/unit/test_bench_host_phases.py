"""bench/host_phases.py on the CPU engine: the timers see the phases a step runs, per step, and every
patched method and function is put back afterwards."""

from __future__ import annotations

import torch

import miles.engine.scheduler as scheduler_module
from bench.host_phases import per_step, timed_phases
from miles.engine.model import Decoder, ModelSpec, load_weights
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler
from miles.engine.staging import InFlight


def test_phases_are_timed_per_step_and_restored(tiny_model):
    sched = Scheduler(
        Decoder(ModelSpec.from_dir(tiny_model), load_weights(tiny_model), "cpu", torch.float32), 4, 2048
    )
    before = (scheduler_module.sampling_rows, InFlight.read, Scheduler.step)
    reqs = [
        Request(str(i), [3, 4, 5, 6 + i], SamplingParams(max_new_tokens=5), i, frozenset()) for i in range(4)
    ]
    with timed_phases(sched) as totals:
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
    assert all(len(r.output) == 5 for r in reqs)
    phases = per_step(totals)
    assert phases["step"]["calls_per_step"] == 1.0
    assert {"_admit", "_retire", "sampling_rows", "_record"} <= set(phases)
    assert all(0 <= v["us_per_step"] <= phases["step"]["us_per_step"] for v in phases.values())
    assert (scheduler_module.sampling_rows, InFlight.read, Scheduler.step) == before
    assert not {"step", "_admit", "_retire"} & set(vars(sched))


def test_cpu_round_times_the_overlapped_loop():
    from bench.host_phases import cpu_round

    phases = cpu_round(requests=4, new_tokens=6)
    # the overlapped loop ran ahead of its readback, and the forward is timed apart from the host's work
    assert phases["_step_ahead"]["calls_per_step"] > 0.5
    assert {"decoder.forward", "_record", "_retire"} <= set(phases)
