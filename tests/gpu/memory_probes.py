"""The measured parts of the GPU memory tests, each run in a fresh Python process.

    python tests/gpu/memory_probes.py engine MODEL
    python tests/gpu/memory_probes.py fsdp MODEL RUNS

A test that reads `torch.cuda.memory_allocated()` / `memory_reserved()` before and after a release
measures the whole process: after other tests in the same pytest process, cached allocator segments
shared with someone else's live tensors cannot be returned, captured graphs keep private pools, and
a garbage collection in the middle frees memory the test never owned. Each probe therefore builds
its own engine or backend in a new process, takes the measurements there, and prints one line
`RESULT {json}`; test_engine_gpu.py and test_fsdp_gpu.py assert on those numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _shown(key: str, value):
    """Byte counts in MiB for the printed line; everything else as it is."""
    byte_keys = ("allocated", "reserved", "bytes")
    return round(value / 2**20, 2) if any(key.endswith(k) for k in byte_keys) else value


def engine(model: str) -> dict:
    """Release and resume of the embedded engine's device memory (weights + KV pool)."""
    import test_engine_gpu as T

    sched = T._scheduler(model)
    work = T._work(6, 2)
    before = [r.output for r in T._run(sched, work)]
    torch.cuda.synchronize()
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    weight_bytes = sum(t.numel() * t.element_size() for t in sched.decoder.params.values())
    pool_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in sched.pool)
    sched.holdings.release_memory()
    released_alloc, released_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    pinned = all(not t.is_cuda and t.is_pinned() for t in sched.decoder.params.values())
    sched.holdings.resume_memory()
    resumed_alloc = torch.cuda.memory_allocated()
    after = [r.output for r in T._run(sched, work)]
    return dict(
        allocated=alloc,
        reserved=reserved,
        weight_bytes=weight_bytes,
        pool_bytes=pool_bytes,
        released_allocated=released_alloc,
        released_reserved=released_reserved,
        weights_pinned_on_host=pinned,
        resumed_allocated=resumed_alloc,
        same_outputs=after == before,
    )


def fsdp(model: str, runs: str) -> dict:
    """offload()/onload() of an FSDP backend after one training step."""
    import test_fsdp_gpu as T

    from miles.cluster.distributed import teardown_distributed

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    samples = T.make_samples(model)
    b = T.fsdp_backend(model, runs, "offload", weight_decay=0.1)
    b.train(samples)
    snap = T.full_weights(b)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    n_params = sum(p.numel() for p in b.model.parameters())
    b.offload()
    torch.cuda.synchronize()
    offloaded = torch.cuda.memory_allocated()
    params_on_cpu = all(p.device.type == "cpu" for p in b.model.parameters())
    try:
        b.train(samples)
        train_error = ""
    except RuntimeError as e:
        train_error = str(e)
    b.onload()
    torch.cuda.synchronize()
    onloaded = torch.cuda.memory_allocated()
    state = [v for s in b.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim]
    res = dict(
        allocated=used,
        n_params=n_params,
        offloaded_allocated=offloaded,
        params_on_cpu_after_offload=params_on_cpu,
        train_while_offloaded_error=train_error,
        onloaded_allocated=onloaded,
        params_on_cuda_after_onload=all(p.device.type == "cuda" for p in b.model.parameters()),
        optimizer_state_on_cuda=bool(state) and all(v.device.type == "cuda" for v in state),
        weights_equal_after_onload=all(torch.equal(v, snap[k]) for k, v in T.full_weights(b).items()),
        loss_after_onload=b.train(samples)["loss"],
        step_after_onload=b.step,
    )
    teardown_distributed()
    return res


def run_probe(*args: str) -> dict:
    """Run `python memory_probes.py ARGS` in a fresh process; its RESULT dict (raises on failure)."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{(out.stdout + out.stderr)[-4000:]}")
    res = json.loads(lines[-1][len("RESULT ") :])
    print(f"{args[0]} probe (MiB):", {k: _shown(k, v) for k, v in res.items()})
    return res


def main() -> None:
    probes = {"engine": engine, "fsdp": fsdp}
    if len(sys.argv) < 3 or sys.argv[1] not in probes:
        raise SystemExit(f"usage: memory_probes.py {{{','.join(probes)}}} MODEL [RUNS]")
    print("RESULT " + json.dumps(probes[sys.argv[1]](*sys.argv[2:])), flush=True)


if __name__ == "__main__":
    main()
