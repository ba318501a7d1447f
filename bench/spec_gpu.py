"""Decode throughput with and without speculation (NEXTN, the model's MTP layer), on one GPU.

    python -m bench.spec_gpu [--sizes 0.5b 7b moe] [--batches 1 8 32 256] [--new 128] [--out F.json]
    python -m bench.spec_gpu --smoke           # the tiny model on the CPU: the script runs
    python -m bench.spec_gpu --profile [--sizes 0.5b] [--batches 1 8]  # where a step's host time goes

Random weights know nothing, so what a trained draft would keep is bracketed by two MTP layers:
- "random": the random MTP layer `miles model init-tiny --mtp` style (miles/models/mtp.py): next to
  nothing kept, the speculation's pure cost;
- "oracle": the target made to predict the next token from the current one alone (attention and MLP
  outputs zero) and the MTP layer passing the next token's embedding through (tests/mtp_oracle.py):
  every proposal kept, the most speculation can give at `--k` drafts a verify.
Per size and bracket a plain engine and a NEXTN engine (`--speculative-num-steps K`) each serve, for
every batch B of `--batches`, one batched /generate of B greedy requests of `--prompt` random ids and
exactly `--new` new tokens (`--max-running-requests` the largest B); tok/s = B * new / wall seconds of
the batch (the best of `--rounds`, after one untimed round of the same batch: graph captures and
kernel compiles happen once in an engine's life). Two NEXTN arms, both with no `--speculative-max-batch` (any batch
may speculate): "NEXTN" speculates in every step (`--no-speculative-adaptive`: the speculation's own cost or gain), "NEXTN adaptive" as the engine
does by default (miles/engine/spec_gate.py: per batch size the faster of speculating and plain decoding,
measured; its probes are part of the figure). "NEXTN default" (`--arms default`): what a recipe gets by default,
the gate plus `--speculative-max-batch 32` (engine.speculative.max_batch). Ratios: each arm / plain of the
same bracket and batch.
`--longtail`: each batch is a long-tailed rollout instead, request i asking for L_i new tokens, Pareto
(`--alpha`) from 8 to `--new` (`--batches 256 --new 1024`: a step's rollout, its last requests decoding
at small batch); tok/s = sum(L) / wall, so a ratio is the rollout's time, plain's / the arm's.
Sizes: Qwen2.5-0.5B and -7B shapes, and the MoE of bench/moe_gpu.py (Qwen3-30B-A3B's layers, 4 of them).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ARMS = {"nextn": "NEXTN", "adaptive": "NEXTN adaptive", "default": "NEXTN default"}
"""`--arms`: the NEXTN arms by their short names (plain always runs: the ratios' anchor)."""


def _shape(size: str, smoke: bool) -> tuple[dict | None, str, int]:
    """(init_random shape, arch, vocab) of a size."""
    from bench.fp8_gpu import QWEN25_7B_SHAPE
    from bench.moe_gpu import QWEN3_30B_A3B_LAYER, TINY_LAYER
    from miles.models.tiny import QWEN25_VOCAB

    if smoke:
        base = {
            k: TINY_LAYER[k]
            for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        }
        return base | {"num_hidden_layers": 2, "intermediate_size": 64}, "qwen2", 512
    if size == "7b":
        return QWEN25_7B_SHAPE, "qwen2", QWEN25_VOCAB
    if size == "moe":
        return QWEN3_30B_A3B_LAYER | {"num_hidden_layers": 4}, "qwen3_moe", QWEN25_VOCAB
    return None, "qwen2", QWEN25_VOCAB  # init_random's default: Qwen2.5-0.5B's shapes


def make_model(size: str, bracket: str, args) -> str:
    """The random model of `size` with an MTP layer, the oracle one for `bracket` "oracle"."""
    from mtp_oracle import oracle_mtp

    from miles.models.mtp import add_mtp_head
    from miles.models.tiny import init_random

    out = Path(args.workdir) / f"{size}-{bracket}"
    if not (out / "config.json").exists():
        shape, arch, vocab = _shape(size, args.smoke)
        dtype = "float32" if args.smoke else "bfloat16"
        init_random(out, shape=shape, vocab_size=vocab, tie_word_embeddings=False, dtype=dtype, arch=arch)
        add_mtp_head(out, seed=0)
        if bracket == "oracle":
            oracle_mtp(out)
    return str(out)


def lengths(batch: int, args) -> list[int]:
    """New tokens per request: `--new` each, or with `--longtail` a Pareto(`--alpha`) tail from 8 to
    `--new` (seeded; the same for every arm): L = min(new, floor(8 * U^(-1/alpha)))."""
    if not args.longtail:
        return [args.new] * batch
    rng = random.Random(0)
    return [min(args.new, int(8 * (1.0 - rng.random()) ** (-1.0 / args.alpha))) for _ in range(batch)]


def throughput(url: str, batch: int, args) -> tuple[float, dict]:
    """tok/s of `batch` greedy requests sent in one batched /generate (all admitted together, as a
    rollout's step hands them over), and the speculative counters summed over the replies."""
    new = lengths(batch, args)
    body = {"input_ids": [[(13 * i + 7 * j) % 300 + 3 for j in range(args.prompt)] for i in range(batch)],
            "sampling_params": [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in new]}  # fmt: skip
    best, counters = 0.0, {}
    for i in range(1 + args.rounds):  # round 0 untimed: the engine captures this batch's graph shapes
        start = time.perf_counter()
        outs = httpx.post(url + "/generate", json=body, timeout=1200).json()
        wall = time.perf_counter() - start
        assert [len(o["output_ids"]) for o in outs] == new, "a request ended early"
        if i:
            best = max(best, sum(new) / wall)
        counters = {k: sum(o["meta_info"].get(k, 0) for o in outs)
                    for k in ("spec_verify_ct", "spec_draft_token_num", "spec_accept_token_num")}  # fmt: skip
    return best, counters


def run(args) -> list[dict]:
    from miles.engine.process import start_engine

    device = "cpu" if args.smoke else "cuda"
    rows = []
    for size in args.sizes:
        for bracket in args.brackets:
            model = make_model(size, bracket, args)
            nextn = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(args.k)]
            flags_of = {
                "plain": [],
                "NEXTN": [*nextn, "--no-speculative-adaptive"],
                "NEXTN adaptive": nextn,
                "NEXTN default": [*nextn, "--speculative-max-batch", "32"],
            }
            for arm in ["plain", *(ARMS[a] for a in args.arms)]:
                flags = flags_of[arm]
                log = Path(args.workdir) / f"engine-{size}-{bracket}-{arm}.log"
                eng = start_engine(
                    model,
                    device=device,
                    log_path=log,
                    extra_args=flags,
                    max_total_tokens=args.pool,
                    max_running_requests=max(args.batches),
                )
                try:
                    for b in args.batches:
                        tok_s, counters = throughput(eng.url, b, args)
                        rows.append(
                            dict(size=size, bracket=bracket, arm=arm, batch=b, tok_s=tok_s, **counters)
                        )
                        print(json.dumps(rows[-1]), flush=True)
                finally:
                    eng.stop()
    return rows


def profile(args) -> None:
    """In process, no server: for each batch B of `--batches`, B greedy requests of `--new` tokens
    submitted together to the scheduler, plain, NEXTN (every step speculating) and NEXTN with the gate,
    per bracket; wall ms
    per token of one request (a plain decode step's time), then the functions taking the most time of the
    `--profile-arm` run at the largest B under cProfile (its own overhead included)."""
    import cProfile
    import pstats

    from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
    from miles.engine.model import ModelSpec
    from miles.engine.mtp import MtpSpeculator, load_mtp
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler
    from miles.engine.spec_gate import Gate

    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    top = max(args.batches)
    for bracket in args.brackets:
        model = make_model(args.sizes[0], bracket, args)
        for arm in ("plain", "NEXTN", "NEXTN adaptive"):
            # running slots (and so CUDA graphs) for a verify's top * (k + 1) rows
            sched = Scheduler(build_decoder(ModelSpec.from_dir(model), model, device, dtype, "none",
                                            DEFAULT_FP8_MIN_TOKENS), top * (args.k + 1), args.pool)  # fmt: skip
            if arm != "plain":
                mtp = load_mtp(model, sched.decoder, sched.max_total_tokens + 1)
                sched.speculator = MtpSpeculator(sched, mtp, args.k)
                sched.speculator.gate = Gate() if arm == "NEXTN adaptive" else None

            rounds: list[float] = []  # speculative rounds a request, per run

            def once(i: int, batch: int, sched=sched, arm=arm, rounds=rounds) -> float:
                params = SamplingParams(max_new_tokens=args.new, temperature=0.0, ignore_eos=True)
                reqs = [Request(f"{arm}-{i}-{b}", [(13 * b + 7 * j) % 300 + 3 for j in range(args.prompt)],
                                params, i, frozenset()) for b in range(batch)]  # fmt: skip
                start = time.perf_counter()
                for req in reqs:
                    sched.submit(req)
                sched.run_until_idle()
                rounds.append(sum(r.spec_verify_ct for r in reqs) / batch)
                return (time.perf_counter() - start) / len(reqs[0].output)

            for batch in args.batches:
                rounds.clear()
                once(0, batch)  # captures graphs, compiles kernels
                times = [once(i, batch) * 1e3 for i in range(1, 1 + args.rounds)]
                gate = sched.speculator.gate if sched.speculator is not None else None
                kept = {k: (b.kept, {m: round(c * 1e3, 3) for m, c in b.cost.items()})
                        for k, b in gate.buckets.items()} if gate is not None else ""  # fmt: skip
                print(f"profile {args.sizes[0]} {bracket} {arm} batch {batch}: {min(times):.2f} ms per token of a "
                      f"request (rounds {' '.join(f'{t:.2f}' for t in times)}; speculative rounds a request "
                      f"{rounds}) {kept}", flush=True)  # fmt: skip
            if arm == args.profile_arm and bracket == args.brackets[0]:
                prof = cProfile.Profile()
                prof.runcall(once, 99, top)
                stats = pstats.Stats(prof)
                stats.sort_stats("tottime").print_stats(30)
                stats.sort_stats("cumulative").print_stats(40)


def table(rows: list[dict]) -> str:
    out = ["| size | draft | arm | batch | plain tok/s | tok/s | / plain | kept / proposed |",
           "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    plain = {(r["size"], r["bracket"], r["batch"]): r for r in rows if r["arm"] == "plain"}
    for r in rows:
        if r["arm"] == "plain":
            continue
        p = plain[(r["size"], r["bracket"], r["batch"])]
        kept = (
            r["spec_accept_token_num"] / r["spec_draft_token_num"]
            if r["spec_draft_token_num"]
            else float("nan")
        )
        out.append(f"| {r['size']} | {r['bracket']} | {r['arm']} | {r['batch']} | {p['tok_s']:.0f} | "
                   f"{r['tok_s']:.0f} | {r['tok_s'] / p['tok_s']:.2f}x | {kept:.2f} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", choices=["0.5b", "7b", "moe"], default=["0.5b", "7b", "moe"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 256])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pool", type=int, default=131072, help="the engines' --max-total-tokens")
    p.add_argument("--brackets", nargs="+", choices=["random", "oracle"], default=["random", "oracle"])
    p.add_argument("--longtail", action="store_true", help="Pareto(--alpha) lengths from 8 to --new")
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["nextn", "adaptive"])
    p.add_argument("--profile", action="store_true", help="in process: plain and NEXTN per batch, cProfile")
    p.add_argument(
        "--profile-arm",
        default="NEXTN",
        choices=["plain", "NEXTN", "NEXTN adaptive"],
        help="the arm --profile runs under cProfile (at the largest batch, the first bracket)",
    )
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--workdir", default=tempfile.mkdtemp(prefix="bench-spec-gpu-"))
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.batches, args.new, args.prompt, args.rounds, args.pool = (
            ["0.5b"],
            [1, 4],
            8,
            8,
            1,
            4096,
        )
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/mtp_oracle.py
    if args.profile:
        profile(args)
        return 0
    rows = run(args)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
