"""DeepSeek models on the CPU: engine against trainer in bf16, routing replay off and on.

    python -m bench.deepseek_r3_cpu [--arch deepseek_v3|deepseek_v4] [--seeds 0 1] [--out F.json]

A tiny model of the family at hidden 256 (V3: 4 layers, the first dense, 8 heads, q rank 96, kv rank
64, 16 routed experts top-4 in 4 groups, best 2, a shared expert; V4: 5 layers of every attention kind,
8 heads of 64, q rank 96, 16 routed experts top-4, the first layer hash-routed, a shared expert, 4
hyper-connection streams), random weights of the seed; 16 random prompts of 8-63 tokens, 64 tokens
sampled at temperature 1 by the embedded engine in bf16 (`miles.align.align`), scored by the FSDP
trainer's model (transformers' class) in bf16 with its routers on their own (off) or replaying the
engine's experts (on). Printed: |delta log p| mean / p99 / max over the 1024 sampled tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

SIZES = {
    "deepseek_v3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
                        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                        moe_intermediate_size=64, num_hidden_layers=4),
    "deepseek_v4": dict(hidden_size=256, num_attention_heads=8, head_dim=64, q_lora_rank=96, n_routed_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=64, intermediate_size=64, o_groups=2,
                        o_lora_rank=32, index_head_dim=32, index_topk=8, sliding_window=16, hc_mult=4),
}  # fmt: skip


def run(arch: str, seed: int) -> list[dict]:
    from miles.align import align
    from miles.models.tiny import init_tiny

    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randint(8, 63))] for _ in range(16)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(init_tiny(Path(tmp) / "m", arch=arch, seed=seed, **SIZES[arch]))
        for replay in (False, True):
            s = align(model, prompts, max_new=64, dtype=torch.bfloat16, replay=replay, seed=seed).summary()
            rows.append(dict(arch=arch, seed=seed, r3="on" if replay else "off", **s))
            print(f"{arch} seed {seed} R3 {rows[-1]['r3']}: mean {s['mean']:.5f} p99 {s['p99']:.4f} "
                  f"max {s['max']:.4f} over {s['tokens']} tokens", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(SIZES), default="deepseek_v4")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out")
    args = p.parse_args(argv)
    rows = [r for seed in args.seeds for r in run(args.arch, seed)]
    print("\n| seed | R3 | mean | p99 | max |\n|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seed']} | {r['r3']} | {r['mean']:.5f} | {r['p99']:.4f} | {r['max']:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
