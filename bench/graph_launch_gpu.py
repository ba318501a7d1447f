"""Host time of one decode-graph replay (`cudaGraphLaunch`) on CUDA, in three situations.

    python -m bench.graph_launch_gpu [--requests 256] [--out F.json]

The engine (bench/engine_gpu.py's shapes: Qwen2.5-0.5B, bf16) captures its decode graph at batch
`--requests` for two context lengths, then times the host side of `DecodeGraphs.run` (input copy,
padding, `graph.replay()`), median of 30:
- idle: the GPU has finished everything before each replay;
- same graph: each replay follows the previous one of the same graph still running on the GPU (the
  overlapped loop's situation);
- alternating: consecutive replays are of the two graphs, so no graph follows itself.
If a replay waits for the previous run of its own graph, `same graph` costs about a GPU step of host
time and `alternating` does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--workdir", default="runs/bench_graph_launch")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.graph_launch_gpu needs a CUDA GPU")
    from bench.fp8_gpu import make_model
    from miles.engine.fp8_weights import build_decoder
    from miles.engine.model import ModelSpec
    from miles.engine.scheduler import Scheduler

    path = make_model(Path(args.workdir), "0.5b", "bfloat16")
    decoder = build_decoder(ModelSpec.from_dir(path), path, "cuda", torch.bfloat16, "none", 1024)
    sched = Scheduler(decoder, args.requests, args.requests * 512 + 4096)
    sched._alloc_memory()
    g = sched.graphs
    contexts = [sched.context_step * 2, sched.context_step * 3]
    inputs = torch.zeros(3, args.requests, dtype=torch.int64, device="cuda")
    inputs[2] = sched.max_running  # the padding row: writes only the scratch slot
    for c in contexts:
        g.run(inputs, c)
    torch.cuda.synchronize()

    def host_ms(order: list[int], idle: bool) -> float:
        times = []
        for c in order:
            if idle:
                torch.cuda.synchronize()
            start = time.perf_counter()
            g.run(inputs, c)
            times.append(1e3 * (time.perf_counter() - start))
        torch.cuda.synchronize()
        return statistics.median(times[2:])

    out = {
        "requests": args.requests,
        "idle_ms": host_ms([contexts[0]] * 32, idle=True),
        "same_graph_ms": host_ms([contexts[0]] * 32, idle=False),
        "alternating_ms": host_ms([contexts[k % 2] for k in range(32)], idle=False),
    }
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        g.run(inputs, contexts[0])
    end.record()
    torch.cuda.synchronize()
    out["gpu_ms"] = start.elapsed_time(end) / 20
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
