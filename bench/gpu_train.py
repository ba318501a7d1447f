"""Training throughput and MFU of the train backends on one GPU, Qwen2.5-0.5B shapes, random init.

    python -m bench.gpu_train --backend megatron --steps 4 --batch 64 --seq 1024

Model FLOPs per step (fwd + bwd = 3 x forward, no recompute), over sequences of length s_i:
    6 * N_matmul * sum_i s_i  +  6 * L * h * sum_i s_i^2
The first term is every linear layer and the LM head (N_matmul parameters, not the embedding
lookup); the second is causal attention (QK^T and AV cost 4 s^2 h forward, half of it under the
causal mask, times 3 for backward). MFU = FLOPs / step time / 790 TFLOP/s, the bf16 matmul rate
measured on this H200. The Megatron step includes its old-log-prob handling (rollout log-probs:
no extra forward) and the optimiser step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from miles.models.tiny import QWEN25_05B_SHAPE as SHAPE
from miles.models.tiny import QWEN25_EOS, QWEN25_PAD
from miles.models.tiny import QWEN25_VOCAB as VOCAB

PEAK = 790e12


def make_model(out: Path) -> Path:
    """Random-init Qwen2.5-0.5B-shaped model (bf16 safetensors, no tokenizer needed for training)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import model_config

    cfg = model_config("qwen2", VOCAB, QWEN25_EOS, QWEN25_PAD, max_position_embeddings=4096, **SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def model_flops(lengths: list[int]) -> float:
    h, L, ffn = SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["intermediate_size"]
    kv = SHAPE["num_key_value_heads"] * h // SHAPE["num_attention_heads"]
    n_matmul = L * (2 * h * h + 2 * h * kv + 3 * h * ffn) + VOCAB * h
    return 6 * n_matmul * sum(lengths) + 6 * L * h * sum(s * s for s in lengths)


def samples(n: int, seq: int, prompt: int, seed: int = 0):
    from miles.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = seq - prompt
        out.append(
            Sample(
                i // 8,
                i % 8,
                [rng.randrange(VOCAB) for _ in range(prompt)],
                [rng.randrange(VOCAB) for _ in range(r)],
                [1] * r,
                [-1.0] * r,
                reward=rng.random(),
            )
        )
    return out


def profile_step(backend, batch) -> None:
    """One more step under the profiler: kernels by total CUDA time, and kernel time vs wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        backend.train(batch)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    print(events.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    kernels = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    print(json.dumps({"profiled_step_wall_s": wall, "kernel_time_s": kernels}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="megatron")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--micro-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--profile", action="store_true", help="print the CUDA kernels of one more step by total time"
    )
    a = ap.parse_args()
    import torch

    from miles.config import Plan
    from miles.train import get_backend

    tmp = Path(tempfile.mkdtemp())
    path = make_model(tmp / "qwen05b")
    plan = Plan.model_validate(
        {
            "model": {"path": str(path), "dtype": "bfloat16"},
            "train": {
                "backend": a.backend,
                "lr": 1e-6,
                "max_tokens_per_microbatch": a.micro_tokens,
                "device": "cuda",
            },
            "run": {"runs_root": str(tmp / "runs")},
        }
    )
    b = get_backend(a.backend)()
    b.setup(plan)
    batch = samples(a.batch, a.seq, a.prompt)
    times = []
    for i in range(a.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = b.train(batch)
        torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    if a.profile:
        profile_step(b, batch)
    lengths = [len(s.tokens) for s in batch]
    flops = model_flops(lengths)
    res = dict(
        backend=a.backend,
        batch=a.batch,
        seq=a.seq,
        micro_tokens=a.micro_tokens,
        step_s=step,
        steps=times,
        tokens_per_s=sum(lengths) / step,
        model_tflop_per_step=flops / 1e12,
        tflops=flops / step / 1e12,
        mfu=flops / step / PEAK,
        peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
        loss=m.get("loss"),
    )
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
