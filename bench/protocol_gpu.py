"""The cost of SGLang's request options on the decode hot path, one engine process on one GPU.

    python -m bench.protocol_gpu [--rounds 3] [--requests 64] [--prompt 128] [--completion 256]

Model: random-init Qwen2.5-0.5B shapes (miles.models.tiny.init_random: 151936-entry vocabulary,
tied embeddings, bf16) with the tiny tokenizer. Every workload generates exactly `completion`
tokens per sequence (ignore_eos, temperature 1) for `requests` sequences, over HTTP:

- `plain`: one batched /generate with the `requests` prompts (the reference);
- `top_logprobs_5`: the same with `return_logprob` and `top_logprobs_num: 5`;
- `n_8`: `requests / 8` prompts with `n: 8` (the same number of sequences);
- `regex`: the same batch with the constraint `[a-z0-9 ]+` (xgrammar mask every step);
- `plain_concurrent`: `requests` single-prompt /generate calls at once over one aiohttp session
  (miles' client library; the reference of streaming);
- `stream`: the same calls with `stream: true`, every server-sent event read.

Throughput = generated tokens / wall seconds from the first request sent to the last reply read.
The workloads run in turn `rounds` times (interleaved), and each round's ratio to that round's
`plain` (or `plain_concurrent`) is reported beside the tok/s range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx


def _batched(url: str, prompts: list[list[int]], sampling: dict, extra: dict | None = None) -> int:
    body = {"input_ids": prompts, "sampling_params": sampling, **(extra or {})}
    r = httpx.post(url + "/generate", json=body, timeout=1200)
    r.raise_for_status()
    return sum(len(x["output_ids"]) for x in r.json())


async def _one(session, url: str, prompt: list[int], sampling: dict, stream: bool) -> int:
    body = {"input_ids": prompt, "sampling_params": sampling, "stream": stream}
    async with session.post(url + "/generate", json=body) as r:
        r.raise_for_status()
        if not stream:
            return len((await r.json())["output_ids"])
        last = None
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                last = json.loads(line[5:])
        return len(last["output_ids"])


def _concurrent(url: str, prompts: list[list[int]], sampling: dict, stream: bool) -> int:
    """Every prompt its own request, all at once, over one aiohttp session (as miles' client)."""
    import aiohttp

    async def go() -> int:
        limits = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=1200)
        async with aiohttp.ClientSession(connector=limits, timeout=timeout) as session:
            counts = await asyncio.gather(*(_one(session, url, p, sampling, stream) for p in prompts))
        return sum(counts)

    return asyncio.run(go())


def workloads(url: str, prompts: list[list[int]], completion: int) -> dict:
    base = {"max_new_tokens": completion, "temperature": 1.0, "ignore_eos": True}
    few = prompts[: max(1, len(prompts) // 8)]

    return {
        "plain": lambda: _batched(url, prompts, base),
        "top_logprobs_5": lambda: _batched(
            url, prompts, base, {"return_logprob": True, "top_logprobs_num": 5}
        ),
        "n_8": lambda: _batched(url, few, {**base, "n": 8}),
        "regex": lambda: _batched(url, prompts, {**base, "regex": "[a-z0-9 ]+"}),
        "plain_concurrent": lambda: _concurrent(url, prompts, base, False),
        "stream": lambda: _concurrent(url, prompts, base, True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--out", default=None, help="write the JSON summary here too")
    args = p.parse_args()

    from miles.engine.process import start_engine
    from miles.models.tiny import init_random

    root = Path(tempfile.mkdtemp(prefix="protocol_gpu-"))
    model = init_random(root / "model")
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 384) for _ in range(args.prompt)] for _ in range(args.requests)]
    slots = args.requests * (args.prompt + args.completion) + 4096
    runs: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    with start_engine(
        model,
        device="cuda",
        max_running_requests=args.requests,
        max_total_tokens=slots,
        log_path=root / "engine.log",
    ) as engine:
        loads = workloads(engine.url, prompts, args.completion)
        _batched(engine.url, prompts, {"max_new_tokens": 16})  # warm-up: graphs, allocator
        for _ in range(args.rounds):
            this = {}
            for name, fn in loads.items():
                start = time.perf_counter()
                tokens = fn()
                this[name] = tokens / (time.perf_counter() - start)
                runs.setdefault(name, []).append(this[name])
            for name, rate in this.items():
                ref = this["plain_concurrent" if name == "stream" else "plain"]
                ratios.setdefault(name, []).append(rate / ref)
    summary = {
        name: {
            "tok_s_median": statistics.median(v),
            "tok_s_min": min(v),
            "tok_s_max": max(v),
            "ratio_to_reference": [round(r, 4) for r in ratios[name]],
        }
        for name, v in runs.items()
    }
    summary["args"] = vars(args)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
