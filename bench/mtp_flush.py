"""`python -m bench.mtp_flush`: the host's share of the MTP's flush of queued plain steps, on the CPU.

A speculating engine whose batch is above `--speculative-max-batch` decodes plain steps and queues
them; every FOLLOW_EVERY steps the MTP layer takes the queue in one forward (miles/engine/mtp.py
`_flush`). Here: the tiny random bench model with an MTP layer (bench/spec_gpu.py `--smoke`'s), an
in-process scheduler of `--batch` greedy requests (`--prompt` ids, `--new` tokens), max batch 32 and
the gate, one thread; a warm-up run, then a run with each flush under cProfile. Printed: flushes, the
own time of the functions of miles/engine/mtp.py and request.py (the host work of building the flush's
batch; cProfile's overhead included) and of `torch.tensor` (lists of ints copied), per flush.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=96)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/mtp_oracle.py
    from bench.spec_gpu import make_model
    from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
    from miles.engine.model import ModelSpec
    from miles.engine.mtp import MtpSpeculator, load_mtp
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler
    from miles.engine.spec_gate import Gate

    torch.set_num_threads(1)
    model = make_model("0.5b", "random", argparse.Namespace(workdir=tempfile.mkdtemp(), smoke=True))
    dec = build_decoder(
        ModelSpec.from_dir(model), model, "cpu", torch.float32, "none", DEFAULT_FP8_MIN_TOKENS
    )
    sched = Scheduler(dec, args.batch, args.batch * (args.prompt + args.new) + 4096)
    sp = sched.speculator = MtpSpeculator(sched, load_mtp(model, dec, sched.max_total_tokens + 1), 3)
    sp.gate, sp.max_batch = Gate(), 32
    prof, flush = cProfile.Profile(), sp._flush

    def profiled() -> None:
        prof.enable()
        flush()
        prof.disable()

    for i in range(2):
        sp._flush = profiled if i else flush
        params = SamplingParams(max_new_tokens=args.new, temperature=0.0, ignore_eos=True)
        for b in range(args.batch):
            ids = [(13 * b + 7 * j + i) % 300 + 3 for j in range(args.prompt)]
            sched.submit(Request(f"{i}-{b}", ids, params, i, frozenset()))
        sched.run_until_idle()
    stats = pstats.Stats(prof).stats
    n = sum(v[0] for k, v in stats.items() if k[2] == "_flush")
    own = sum(v[2] for k, v in stats.items() if k[0].endswith(("engine/mtp.py", "engine/request.py")))
    copied = sum(v[2] for k, v in stats.items() if k[2] == "<built-in method torch.tensor>")
    print(f"flushes {n}: own time of mtp.py and request.py {own * 1e3 / n:.1f} ms a flush, "
          f"torch.tensor {copied * 1e3 / n:.2f} ms a flush")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
