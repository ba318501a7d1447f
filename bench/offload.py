"""Optimiser offload benchmark: NVMe streaming bandwidth vs the raw disk, step overhead, memory saved.

    python -m bench.offload --params-m 100 --bucket-mb 64 --steps 4              # CPU machine
    python -m bench.offload --device cuda --model qwen0.5b --steps 6             # GPU machine

1. Raw disk: a file of the same size as the optimiser state is written sequentially in bucket-sized
   chunks (fsync at the end) and read back, with the same I/O mode the store uses (O_DIRECT when
   the filesystem allows it: the page cache cannot be dropped here, O_DIRECT bypasses it).
2. Each optimiser runs in its own process (so peak memory is its own): torch AdamW in memory,
   OffloadedAdamW cpu, OffloadedAdamW nvme. Optimiser-only mode steps synthetic parameters with
   fixed gradients; `--model qwen0.5b` times full train steps (forward + backward + step) of a
   random-init Qwen2.5-0.5B-shaped model, bf16 autocast, fp32 master parameters.
3. Streaming efficiency = (bytes read / raw read GB/s + bytes written / raw write GB/s) / step time:
   1.0 means the step moved its state as fast as the disk moves it alone (reads and writes share
   the disk, so their times add). Target >= 0.7. Peak memory: max RSS of each process, and on CUDA
   the peak device memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from miles.models.tiny import QWEN25_05B_SHAPE, QWEN25_VOCAB

QWEN_05B = dict(
    QWEN25_05B_SHAPE, vocab_size=QWEN25_VOCAB, max_position_embeddings=4096, tie_word_embeddings=True
)


def raw_disk(directory: Path, total: int, chunk: int) -> dict:
    """Sequential write (fsync at end) and read of `total` bytes in `chunk`-byte calls."""
    from miles.train.offload.fileio import probe_direct_io
    from miles.train.offload.layout import aligned_empty

    direct = probe_direct_io(directory)
    buf = aligned_empty(chunk)
    buf.random_(0, 255)
    view = memoryview(buf.numpy())
    path = directory / "raw.bin"
    flags = os.O_DIRECT if direct else 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    t0 = time.perf_counter()
    for off in range(0, total, chunk):
        os.pwrite(fd, view, off)
    os.fsync(fd)
    write_s = time.perf_counter() - t0
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | flags)
    t0 = time.perf_counter()
    for off in range(0, total, chunk):
        os.preadv(fd, [view], off)
    read_s = time.perf_counter() - t0
    os.close(fd)
    mixed_s = _read_while_writing(path, directory / "raw2.bin", total, chunk, flags)
    path.unlink()
    size = -(-total // chunk) * chunk
    return {
        "direct": direct,
        "bytes": size,
        "write_GBps": size / write_s / 1e9,
        "read_GBps": size / read_s / 1e9,
        "mixed_GBps": 2 * size / mixed_s / 1e9,
    }


def _read_while_writing(src: Path, dst: Path, total: int, chunk: int, flags: int) -> float:
    """Seconds to read `src` and write a new `dst` of the same size at once (what a step does)."""
    from miles.train.offload.layout import aligned_empty

    def read() -> None:
        buf = memoryview(aligned_empty(chunk).numpy())
        fd = os.open(src, os.O_RDONLY | flags)
        for off in range(0, total, chunk):
            os.preadv(fd, [buf], off)
        os.close(fd)

    def write() -> None:
        buf = memoryview(aligned_empty(chunk).numpy())
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        for off in range(0, total, chunk):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=read), threading.Thread(target=write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    dst.unlink()
    return elapsed


def _synthetic_params(numel: int, device: str):
    """Tensors shaped like a transformer's: big matrices, some vectors, one embedding-sized slab."""
    import torch

    sizes, left = [], numel
    sizes.append(min(left, numel // 5))
    left -= sizes[-1]
    while left > 0:
        for n in (4096 * 1024, 1024 * 1024, 4096, 1024):
            if left <= 0:
                break
            sizes.append(min(n, left))
            left -= sizes[-1]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(device)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device) * 1e-3
    return params


def _make_optimizer(kind: str, params, args):
    import torch

    from miles.train.offload import OffloadedAdamW

    if kind in ("adamw", "adamw_single"):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=kind == "adamw")
    return OffloadedAdamW(
        params,
        lr=1e-4,
        weight_decay=0.1,
        mode=kind,
        bucket_bytes=args.bucket_mb * 2**20,
        directory=str(args.dir),
        require_local=False,
    )


def _model_step_fn(args):
    """A closure doing forward + backward of a Qwen2.5-0.5B-shaped model; returns (params, fn)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).to(args.device)
    ids = torch.randint(0, QWEN_05B["vocab_size"], (args.batch, args.seq), device=args.device)

    def fwd_bwd() -> None:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return list(model.parameters()), fwd_bwd


def worker(kind: str, args) -> dict:
    """Time `args.steps` steps of one optimiser kind in this process; report per-step numbers."""
    import torch

    cuda = args.device == "cuda"
    if args.model == "none":
        params, fwd_bwd = _synthetic_params(args.params_m * 10**6, args.device), None
    else:
        params, fwd_bwd = _model_step_fn(args)
    opt = _make_optimizer(kind, params, args)
    times, io = [], []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        stats = getattr(getattr(opt, "store", None), "stats", None)
        before = (stats.read_bytes, stats.write_bytes) if stats else (0, 0)
        t0 = time.perf_counter()
        if fwd_bwd:
            opt.zero_grad(set_to_none=True)
            fwd_bwd()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        after = (stats.read_bytes, stats.write_bytes) if stats else (0, 0)
        io.append((after[0] - before[0], after[1] - before[1]))
    # the first step builds state (nothing to read back yet) and early steps fault in fresh memory
    # (slow on VMs that back guest memory lazily): report the median of the second half
    steady = times[len(times) // 2 :]
    out = {
        "kind": kind,
        "step_s": statistics.median(steady),
        "step_times_s": [round(t, 4) for t in times],
        "read_bytes": io[-1][0],
        "write_bytes": io[-1][1],
        "state_bytes": opt.state_bytes() if hasattr(opt, "state_bytes") else None,
        "direct_io": getattr(getattr(opt, "store", None), "direct", None),
        "buckets": len(getattr(opt, "buckets", [])),
        "params": sum(p.numel() for p in params),
    }
    if cuda:
        out["cuda_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    if hasattr(opt, "close"):
        opt.close()
    return out


def run_worker(kind: str, argv: list[str]) -> dict:
    """Run one optimiser kind in a child process; add its peak RSS (from wait4)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.offload", "--worker", kind, *argv], stdout=subprocess.PIPE, text=True
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {kind} failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_GB"] = usage.ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux
    return result


def _machine(args) -> str:
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg()[0]
    return (
        f"{platform.node()} ({os.cpu_count()} cores, {cpu}, {args.device}; load average {load:.1f} at start)"
    )


def report(machine: str, args, raw: dict, res: dict[str, dict], command: str) -> str:
    """A markdown section with the command, the machine and every number."""
    nv, mem, cpu = res["nvme"], res["adamw"], res["cpu"]
    moved = nv["read_bytes"] + nv["write_bytes"]
    serial = nv["read_bytes"] / (raw["read_GBps"] * 1e9) + nv["write_bytes"] / (raw["write_GBps"] * 1e9)
    kinds = ("adamw", "adamw_single", "cpu", "nvme")
    lines = [
        f"### Optimizer offload ({time.strftime('%Y-%m-%d %H:%M')}, {machine})",
        "",
        f"`{command}`",
        "",
        f"- state: {nv['state_bytes'] / 1e9:.2f} GB for {nv['params'] / 1e6:.0f}M parameters, "
        f"{nv['buckets']} buckets of {args.bucket_mb} MiB; I/O mode {'O_DIRECT' if raw['direct'] else 'buffered'}",
        f"- raw disk, same total size, chunk and I/O mode: write {raw['write_GBps']:.2f} GB/s, read "
        f"{raw['read_GBps']:.2f} GB/s, read+write at once {raw['mixed_GBps']:.2f} GB/s combined",
        f"- nvme streaming step (median): read {nv['read_bytes'] / nv['step_s'] / 1e9:.2f} GB/s + write "
        f"{nv['write_bytes'] / nv['step_s'] / 1e9:.2f} GB/s = {moved / nv['step_s'] / 1e9:.2f} GB/s combined "
        f"= {moved / nv['step_s'] / 1e9 / raw['mixed_GBps']:.0%} of the raw read+write-at-once rate; "
        f"{serial / nv['step_s']:.0%} of the raw read-then-write time (target >= 70%)",
        "- step time (median of the second half of the steps): "
        + ", ".join(f"{k} {res[k]['step_s'] * 1e3:.0f} ms" for k in kinds)
        + f"; vs in-memory AdamW (foreach): cpu {cpu['step_s'] / mem['step_s']:.2f}x, "
        f"nvme {nv['step_s'] / mem['step_s']:.2f}x",
        "- peak host RSS: "
        + ", ".join(f"{k} {res[k]['peak_rss_GB']:.2f} GB" for k in kinds)
        + f"; nvme saves {mem['peak_rss_GB'] - nv['peak_rss_GB']:.2f} GB vs in-memory AdamW (foreach)",
    ]
    if args.device == "cuda":
        lines.append(
            "- peak device memory: " + ", ".join(f"{k} {res[k]['cuda_peak_GB']:.2f} GB" for k in kinds)
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", choices=["none", "qwen0.5b"], default="none", help="none: optimiser step only")
    ap.add_argument("--params-m", type=int, default=100, help="synthetic parameters, millions (--model none)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("runs/bench_offload"), help="on the disk to measure")
    ap.add_argument("--append", type=Path, default=None, help="append the markdown section to this file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    machine = _machine(args)
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    child_argv = list(argv)
    if "--append" in child_argv:
        i = child_argv.index("--append")
        del child_argv[i : i + 2]
    try:
        res = {"nvme": run_worker("nvme", child_argv)}
        raw = raw_disk(args.dir, res["nvme"]["state_bytes"], args.bucket_mb * 2**20)
        res["cpu"] = run_worker("cpu", child_argv)
        res["adamw"] = run_worker("adamw", child_argv)
        res["adamw_single"] = run_worker("adamw_single", child_argv)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    text = report(machine, args, raw, res, "python -m bench.offload " + " ".join(argv))
    print(text)
    print(json.dumps({"raw": raw, **res}, indent=1), file=sys.stderr)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
