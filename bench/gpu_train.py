"""Training throughput and MFU of the train backends on one GPU, Qwen2.5-0.5B shapes, random init.

    python -m bench.gpu_train --backend megatron --steps 4 --batch 64 --seq 1024
    python -m bench.gpu_train --backend megatron --layout padded --responses 16:1024   # long-tailed mix

`--layout` (Megatron): `packed` rows of several sequences with the variable-length attention kernel
(the default without Transformer Engine), or `padded` rows of one sequence each (the layout used with
Transformer Engine). `--responses LO:HI` draws each response length uniformly from LO..HI (seeded, the
same batch for both layouts) instead of `seq - prompt` for all; tokens_per_s counts real tokens only.

Model FLOPs per step (fwd + bwd = 3 x forward, no recompute), over sequences of length s_i of
which r_i are response tokens:
    6 * N_body * sum_i s_i  +  6 * V * h * (positions given to the LM head)  +  6 * L * h * sum_i s_i^2
N_body is every linear layer of the decoder (not the embedding lookup), V * h the LM head, and the
last term causal attention (QK^T and AV cost 4 s^2 h forward, half of it under the causal mask,
times 3 for backward). The LM head runs only where it is computed: Megatron applies it to the
sum_i r_i positions that score response tokens (`response_head` in miles/train/megatron/batch.py), FSDP to
all sum_i s_i positions.

MFU (the standard one) = those FLOPs / step time / 989 TFLOP/s, the dense bf16 peak of the H200 SXM
datasheet. Also reported, as in the older entries of bench/RESULTS.md: the LM head counted on every
position, over the 790 TFLOP/s bf16 matmul rate measured on this H200 (`mfu_all_positions_vs_790`);
it reads higher and is not comparable with MFU figures published elsewhere. The Megatron step
includes its old-log-prob handling (rollout log-probs: no extra forward) and the optimiser step.
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

PEAK_DATASHEET = 989e12  # H200 SXM dense bf16, datasheet
MATMUL_MEASURED = 790e12  # 8192^3 bf16 matmul through torch on this H200 (random data)


def make_model(out: Path) -> Path:
    """Random-init Qwen2.5-0.5B-shaped model (bf16 safetensors, no tokenizer needed for training)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import model_config

    cfg = model_config("qwen2", VOCAB, QWEN25_EOS, QWEN25_PAD, max_position_embeddings=4096, **SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def model_flops(lengths: list[int], head_positions: int | None = None) -> float:
    """Training FLOPs of one step over sequences of `lengths`; the LM head on `head_positions`
    positions (None: every position)."""
    h, L, ffn = SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["intermediate_size"]
    kv = SHAPE["num_key_value_heads"] * h // SHAPE["num_attention_heads"]
    n_body = L * (2 * h * h + 2 * h * kv + 3 * h * ffn)
    head = sum(lengths) if head_positions is None else head_positions
    return 6 * n_body * sum(lengths) + 6 * VOCAB * h * head + 6 * L * h * sum(s * s for s in lengths)


def mfu_figures(backend: str, lengths: list[int], responses: list[int], step_s: float) -> dict:
    """The standard MFU (positions computed, datasheet peak) and the older definition beside it."""
    computed = model_flops(lengths, sum(responses) if backend == "megatron" else None)
    everywhere = model_flops(lengths)
    return dict(
        model_tflop_per_step=computed / 1e12,
        tflops=computed / step_s / 1e12,
        mfu=computed / step_s / PEAK_DATASHEET,
        tflop_per_step_all_positions=everywhere / 1e12,
        mfu_all_positions_vs_790=everywhere / step_s / MATMUL_MEASURED,
    )


def samples(n: int, seq: int, prompt: int, seed: int = 0, responses: tuple[int, int] | None = None):
    from miles.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.randint(*responses) if responses else seq - prompt
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
    ap.add_argument("--layout", choices=["auto", "packed", "padded"], default="auto",
                    help="train.micro_batch_layout (Megatron)")  # fmt: skip
    ap.add_argument("--responses", default=None, help="LO:HI, response lengths uniform in LO..HI")
    ap.add_argument("--out", default=None)
    ap.add_argument("--advantage", choices=["grpo", "ppo"], default="grpo",
                    help="ppo: the step also runs the critic (values, GAE, value update)")  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true", help="print the CUDA kernels of one more step by total time"
    )
    a = ap.parse_args()
    import torch

    from miles.config import Plan
    from miles.train import get_backend

    responses = tuple(int(x) for x in a.responses.split(":")) if a.responses else None
    tmp = Path(tempfile.mkdtemp())
    path = make_model(tmp / "qwen05b")
    plan = Plan.model_validate(
        {
            "model": {"path": str(path), "dtype": "bfloat16"},
            "train": {
                "backend": a.backend,
                "lr": 1e-6,
                "max_tokens_per_microbatch": a.micro_tokens,
                "micro_batch_layout": a.layout,
                "device": "cuda",
                "loss": {"advantage": a.advantage},
            },
            "run": {"runs_root": str(tmp / "runs")},
        }
    )
    b = get_backend(a.backend)()
    b.setup(plan)
    batch = samples(a.batch, a.seq, a.prompt, responses=responses)
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
    responses = [len(s.response_ids) for s in batch]
    res = dict(
        backend=a.backend,
        advantage=a.advantage,
        layout=a.layout,
        batch=a.batch,
        seq=a.seq,
        responses=a.responses,
        micro_tokens=a.micro_tokens,
        step_s=step,
        steps=times,
        tokens_per_s=sum(lengths) / step,
        **mfu_figures(a.backend, lengths, responses, step),
        peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
        loss=m.get("loss"),
    )
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
