"""Trainer memory of LoRA against full fine-tuning: the FSDP backend's parameters, gradients and AdamW state.

    python -m bench.lora_memory [--shape 0.5b|tiny] [--rank 16]

One process, one gloo rank on the CPU (a GPU is not needed: the figures are tensor bytes, the same on any
device). For each of full training and `train.lora` (rank --rank on every attention and MLP projection):
the backend is set up on a random-init model of the shape (Qwen2.5-0.5B by default, fp32 master weights as
the trainer keeps them), one training step runs on a small batch so that gradients and AdamW state exist,
and the bytes of every parameter, every gradient and every optimiser state tensor are summed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure(model_path: str, lora: dict | None, workdir: str) -> dict:
    from miles.cluster.distributed import teardown_distributed
    from miles.config import resolve
    from miles.sample import Sample
    from miles.train import get_backend

    train = {"backend": "fsdp", "lr": 1e-4, "max_tokens_per_microbatch": 256, "loss": {"entropy_coef": 0.01}}
    if lora is not None:
        train["lora"] = lora
    plan = resolve({"model": {"path": model_path, "dtype": "float32"}, "train": train,
                    "run": {"runs_root": workdir, "name": "mem-lora" if lora else "mem-full"}})  # fmt: skip
    backend = get_backend("fsdp")()
    try:
        backend.setup(plan)
        samples = [
            Sample(0, i, [5, 6, 7, 8], [9, 10, 11], [1, 1, 1], [-1.0] * 3, reward=float(i % 2))
            for i in range(4)
        ]
        backend.train(samples)
        params = [p for p in backend.model.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        state = [t for s in backend.optimizer.state.values() for t in s.values()]
        return dict(
            trainable=sum(p.numel() for p in params if p.requires_grad),
            params_bytes=_bytes(p.to_local() if hasattr(p, "to_local") else p for p in params),
            grad_bytes=_bytes(g.to_local() if hasattr(g, "to_local") else g for g in grads),
            optimizer_bytes=_bytes(t.to_local() if hasattr(t, "to_local") else t for t in state),
        )
    finally:
        teardown_distributed()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["0.5b", "tiny"], default="0.5b")
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args(argv)
    from miles.models.tiny import QWEN25_05B_SHAPE, init_random, init_tiny

    work = tempfile.mkdtemp(prefix="lora-mem-")
    path = Path(work) / "model"
    if args.shape == "tiny":
        init_tiny(path)
    else:
        init_random(path, shape=QWEN25_05B_SHAPE, dtype="float32")
    lora = {"rank": args.rank, "alpha": 2 * args.rank}
    rows = {"full": measure(str(path), None, work), "lora": measure(str(path), lora, work)}
    mib = 2**20
    print(
        f"bench.lora_memory --shape {args.shape} --rank {args.rank} (one gloo rank, CPU, fp32 master weights)"
    )
    print(
        "| training | trainable parameters | parameters MiB | gradients MiB | AdamW state MiB | total MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        total = r["params_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        print(f"| {name} | {r['trainable']:,} | {r['params_bytes'] / mib:.0f} | {r['grad_bytes'] / mib:.1f} | "
              f"{r['optimizer_bytes'] / mib:.1f} | {total / mib:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
