"""`make bench` / `python -m bench [--gpu]`: run the benchmark suite of this machine, one after the other.

CPU (default): engine decode vs `generate`, fully async vs synchronous rollout, NVMe optimizer offload,
the session server's per-turn overhead, sandbox start-up, multi-turn episodes async vs sync, and what
a dedicated evaluation costs training.
GPU (`--gpu`, on a CUDA machine): decode attention kernel, engine vs `generate`, SGLang request options
on the decode hot path, training MFU of both
backends, the bf16 log-prob mismatch, the end-to-end GRPO step colocated (TRL's side is
bench/trl_grpo.py, which needs the `trl` package), FP8 against bf16 (engine tok/s at 0.5B and
7B shapes, train step, log-prob mismatch over 20 GRPO steps), and mixture of experts (engine decode
against a dense model of the same active size, mismatch over 20 GRPO steps with and without routing
replay). Each benchmark prints its own table;
the numbers worth keeping go to bench/RESULTS.md with the date, machine and command.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CPU = [
    ["bench.engine_decode"],
    ["bench.async_vs_sync", "--steps", "12"],
    ["bench.offload", "--params-m", "50", "--steps", "6"],
    ["bench.session_overhead"],
    ["bench.sandbox_start"],
    ["bench.agentic_async", "--steps", "10"],
    ["bench.eval_overhead", "--steps", "48"],
]
GPU = [
    ["bench.decode_attention_gpu"],
    ["bench.engine_gpu", "--skip-eager"],
    ["bench.protocol_gpu", "--requests", "256", "--completion", "512"],
    ["bench.gpu_train", "--backend", "megatron", "--steps", "3"],
    ["bench.gpu_train", "--backend", "fsdp", "--steps", "3"],
    ["bench.logprob_mismatch_gpu", "--requests", "32"],
    ["bench.e2e_gpu", "--layout", "colocated", "--backend", "megatron", "--steps", "5"],
    ["bench.fp8_gpu"],
    ["bench.moe_gpu"],
]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="the GPU suite instead of the CPU one")
    args = p.parse_args()
    failed = []
    for cmd in GPU if args.gpu else CPU:
        print(f"\n=== python -m {' '.join(cmd)}", flush=True)
        if subprocess.run([sys.executable, "-m", *cmd]).returncode != 0:
            failed.append(cmd[0])
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
