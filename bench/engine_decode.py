"""Decode throughput: the embedded engine (continuous batching) vs transformers' `generate`.

    python -m bench.engine_decode [--requests 256] [--concurrency 64] [--short 32] [--long-every 10]
                                  [--workload long-tailed|equal] (default: both)

Model: init_tiny(hidden 256, 4 layers, intermediate 512, 8 heads, 4 kv heads), fp32 on CPU.
Workloads (prompts of 16-64 random tokens, lengths forced with ignore_eos + max_new_tokens):
  long-tailed  most requests `short` new tokens, every `long_every`-th one 8x longer;
  equal        every request `short` * 2 new tokens.
Engine: one engine process, the requests sent through the SGLang client with at most
`concurrency` in flight (a finished request frees its slot at once). generate: the same requests
in order, in left-padded batches of `concurrency`, each batch run to its longest request; only
the tokens each request asked for count as useful. Throughput = useful tokens / wall seconds.
Both sides run torch with the same intra-op thread count (printed; the engine child inherits the
environment, so OMP_NUM_THREADS, when set, applies to both).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path

SIZES = dict(
    hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4
)

WORKLOADS = {"long-tailed": False, "equal": True}  # name -> equal lengths


def workload(n: int, short: int, long_every: int, equal: bool, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 380) for _ in range(rng.randint(16, 64))]
        length = 2 * short if equal else (8 * short if i % long_every == long_every - 1 else short)
        out.append((prompt, length))
    return out


def run_engine(model: Path, work, concurrency: int) -> float:
    from miles.engine.process import start_engine
    from miles.rollout.client import SGLangClient

    with start_engine(model, device="cpu", max_running_requests=concurrency) as engine:
        client = SGLangClient(engine.url)

        async def go() -> float:
            gate = asyncio.Semaphore(concurrency)

            async def one(prompt, n):
                async with gate:
                    r = await client.generate(
                        prompt, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                    )
                    assert len(r.output_ids) == n
                    return n

            await client.generate([1, 2, 3], {"max_new_tokens": 4})  # warm-up
            start = time.perf_counter()
            await asyncio.gather(*(one(p, n) for p, n in work))
            return time.perf_counter() - start

        return asyncio.run(go())


def run_generate(model: Path, work, batch: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id
    hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        assert out.shape[1] == width + longest
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--short", type=int, default=32)
    p.add_argument("--long-every", type=int, default=10)
    p.add_argument("--workload", choices=list(WORKLOADS), action="append", help="repeatable; default: both")
    args = p.parse_args()
    import torch

    from miles.models.tiny import init_tiny

    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"intra-op threads: {torch.get_num_threads()} for generate and the engine (OMP_NUM_THREADS={threads})"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "model", arch="qwen2", **SIZES)
        print(f"{'workload':<12} {'useful tok':>10} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>6}")
        for name in args.workload or list(WORKLOADS):
            equal = WORKLOADS[name]
            work = workload(args.requests, args.short, args.long_every, equal)
            useful = sum(n for _, n in work)
            t_engine = run_engine(model, work, args.concurrency)
            t_hf = run_generate(model, work, args.concurrency)
            e, h = useful / t_engine, useful / t_hf
            print(f"{name:<12} {useful:>10} {e:>13.0f} {h:>15.0f} {e / h:>6.2f}")


if __name__ == "__main__":
    main()
