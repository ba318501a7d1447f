"""One sparse layer's expert sum on one GPU: the fused Triton path against torch._grouped_mm, and the
fused kernel's tile settings.

    python -m bench.moe_experts_gpu [--tokens 256 32] [--sweep] [--out F.json]

Shapes: Qwen3-30B-A3B's layer (hidden 2048, 128 experts top-8 renormalised, expert intermediate 768),
bf16, random weights and inputs, the router's choice of experts (miles/engine/moe.py `route`). For
each token count T: the time of `experts` (everything after the router: alignment or sort, both
projections, the activation, the weighted sum) captured in a CUDA graph, median of 5 x 50 replays;
the weight bytes the step must read (the experts hit at least once x 3 x H x I x 2 bytes) over that
time, as GB/s against the card's ~4.3 TB/s copy rate; and the largest difference of the fused
output from the grouped one, relative to the largest entry. `--sweep` also times the fused path
under each tile setting of SWEEP.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from miles.engine import moe, triton_moe

H, INTER, E, K = 2048, 768, 128, 8
SWEEP = [
    dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4),
    dict(BM=16, BN=128, BK=128, num_warps=4, num_stages=3),
    dict(BM=16, BN=64, BK=256, num_warps=4, num_stages=3),
    dict(BM=16, BN=32, BK=256, num_warps=4, num_stages=4),
    dict(BM=16, BN=128, BK=64, num_warps=4, num_stages=5),
    dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=4),
    dict(BM=32, BN=128, BK=128, num_warps=8, num_stages=3),
    dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3),
]


def graph_time(fn, reps: int = 50) -> float:
    """Median seconds of one call, replayed from a CUDA graph (5 batches of `reps`)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 32])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda"
    gate = torch.randn(E, H, device=dev).bfloat16()
    gate_up = (torch.randn(E, 2 * INTER, H, device=dev) / 45).bfloat16()
    down = (torch.randn(E, H, INTER, device=dev) / 28).bfloat16()
    rows = []
    for T in args.tokens:
        x = torch.randn(T, H, device=dev).bfloat16()
        weights, ids = moe.route(x, gate, K, True)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * H * INTER * 2
        grouped = moe.experts_grouped(x, ids, weights, gate_up, down)
        fused = moe.experts_fused(x, ids, weights, gate_up, down)
        err = float((fused.float() - grouped.float()).abs().max() / grouped.float().abs().max())
        for name, fn in arms(x, ids, weights, gate_up, down, SWEEP if args.sweep else []).items():
            t = graph_time(fn)
            row = dict(tokens=T, arm=name, us=t * 1e6, gb_s=nbytes / t / 1e9, experts_hit=hit, rel_err=err)
            rows.append(row)
            print(
                f"T={T:4d} {name:70s} {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.0f} GB/s  hit {hit}", flush=True
            )
        print(f"T={T}: fused vs grouped max rel diff {err:.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def arms(x, ids, weights, gate_up, down, sweep: list[dict]) -> dict:
    """name -> a call of one expert path on these inputs."""
    from miles.engine import triton_fused

    out = {
        "grouped": lambda: moe.experts_grouped(x, ids, weights, gate_up, down),
        "fused": lambda: moe.experts_fused(x, ids, weights, gate_up, down),
    }
    for cfg in sweep:
        out[f"fused {cfg}"] = lambda cfg=cfg: moe._combine(
            x, triton_moe.experts_fused(x, ids, gate_up, down, triton_fused.silu_mul, cfg=cfg), weights
        )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
