"""Decode throughput: the embedded engine (continuous batching) vs transformers' `generate`.

    python -m bench.engine_decode [--requests 256] [--concurrency 64] [--short 32] [--long-every 10]
                                  [--workload long-tailed|equal] (default: both)

Model: init_tiny(hidden 256, 4 layers, intermediate 512, 8 heads, 4 kv heads), fp32 on CPU.
Workloads (prompts of 16-64 random tokens, lengths forced with ignore_eos + max_new_tokens):
  long-tailed  most requests `short` new tokens, every `long_every`-th one 8x longer;
  equal        every request `short` * 2 new tokens.
Engine, two ways: in-process (the requests submitted straight to the engine's scheduler, which runs
at most `concurrency` of them and admits the next the moment one finishes: the decode throughput of the
engine itself, measured like `generate`, in this process), and over HTTP (one engine process, the
requests sent through the SGLang client with at most `concurrency` in flight; the client's own work
shares the machine's cores with the engine). generate: the same requests
in order, in left-padded batches of `concurrency`, each batch run to its longest request; only
the tokens each request asked for count as useful. Throughput = useful tokens / wall seconds.
Both sides run torch with the same intra-op thread count (printed; the engine child inherits the
environment, so OMP_NUM_THREADS, when set, applies to both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
            elapsed = time.perf_counter() - start
            await client.aclose()
            return elapsed

        return asyncio.run(go())


def run_engine_in_process(model: Path, work, concurrency: int) -> float:
    """The same requests straight into the engine's scheduler (no HTTP, no client): all submitted at
    once, at most `concurrency` running, the rest waiting for a free row, exactly as the server does."""
    import torch

    from miles.engine.model import Decoder, ModelSpec, load_weights
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    decoder = Decoder(ModelSpec.from_dir(model), load_weights(model), "cpu", torch.float32)
    sched = Scheduler(decoder, concurrency, 65536)

    def run(items) -> list[Request]:
        reqs = []
        for i, (prompt, n) in enumerate(items):
            sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            reqs.append(Request(rid=str(i), prompt=list(prompt), params=sp, seed=i, stop_ids=frozenset()))
            sched.submit(reqs[-1])
        sched.run_until_idle()
        return [r.done.result(timeout=0) for r in reqs]

    run([([1, 2, 3], 4)])  # warm-up (allocates the KV memory)
    start = time.perf_counter()
    done = run(work)
    elapsed = time.perf_counter() - start
    assert [len(r.output) for r in done] == [n for _, n in work]
    return elapsed


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
    p.add_argument("--out", default=None, help="write tok/s and ratios per workload as JSON here")
    args = p.parse_args()
    import torch

    from miles.models.tiny import init_tiny

    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"intra-op threads: {torch.get_num_threads()} for generate and the engine (OMP_NUM_THREADS={threads})"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "model", arch="qwen2", **SIZES)
        head = f"{'workload':<12} {'useful tok':>10} {'engine in-process':>18} {'engine HTTP':>12}"
        print(head + f" {'generate':>9}   tokens/s; ratios in-process / HTTP vs generate")
        results = {}
        for name in args.workload or list(WORKLOADS):
            equal = WORKLOADS[name]
            work = workload(args.requests, args.short, args.long_every, equal)
            useful = sum(n for _, n in work)
            t_local = run_engine_in_process(model, work, args.concurrency)
            t_http = run_engine(model, work, args.concurrency)
            t_hf = run_generate(model, work, args.concurrency)
            e, w, h = useful / t_local, useful / t_http, useful / t_hf
            print(f"{name:<12} {useful:>10} {e:>18.0f} {w:>12.0f} {h:>9.0f}   {e / h:.2f} / {w / h:.2f}")
            results[name] = dict(engine_tok_s=e, http_tok_s=w, generate_tok_s=h, engine_vs_generate=e / h)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
