"""INT4 (W4A16) against bf16 on one GPU, in one run: GEMM, decode tok/s, weight push, train-rollout mismatch.

    python -m bench.int4_gpu [--part gemm|decode|push|mismatch ...] [--rounds 2] [--out F.json]
    python -m bench.int4_gpu --smoke      # CPU, tiny models, small sizes: the plumbing, not figures

Parts (`--part`, repeatable; all by default), run in the order mismatch, push, gemm, decode:

1. mismatch: `miles train` with bench/e2e_gpu.py's colocated synchronous GRPO recipe on Qwen2.5-0.5B
   shapes (bench/fp8_gpu.py's mismatch settings: fixed seed, 16 prompts x 8 samples, prompt 128, 256 new
   tokens, old log-probs recomputed, TIS truncate at 2), `--mm-steps` steps each of: bf16 engine + bf16
   trainer; int4 engine (every linear layer, groups of 128) + trainer without the contract
   (train.quantization=none: a bf16 forward); int4 engine + int4_qat. The int4 runs check after every push
   that the engine's bytes equal the trainer's (weights.check). From metrics.jsonl per step:
   train/logprob_mismatch, weights/checksum_mismatch, weights/push_s and weights/push_bytes (the bytes
   the trainer exported into the push).
2. push: in process, for the 0.5B and 7B shapes: the bytes of the exported weights in bf16 and as int4
   parts, and the time to quantise the bf16 tensors on the GPU and load the parts into a CUDA int4 engine
   against loading the bf16 tensors into a bf16 engine (no transport; median of `--rounds`).
3. gemm: one linear layer of the 7B shapes (3584 -> 18944 and 18944 -> 3584): tinygemm W4A16 against
   bf16 F.linear at 1 to 4096 rows, CUDA events, median of 50.
4. decode: the embedded engine in this process (bench/fp8_gpu.py's in-process Scheduler, CUDA graphs,
   temperature 1, ignore_eos) on Qwen2.5-7B shapes (int4 on every linear layer, group 128) and on
   bench/moe_gpu.py's MoE model (Qwen3-30B-A3B layer shapes, `--moe-layers` layers; int4 on the
   experts, upstream's default): batches of 1, 32 and 256 requests (prompt 128, 128 new tokens).
   Arms: bf16; int4 at its default (GEMMs of at most 4 rows through tinygemm, larger ones on the bf16
   copy); int4 @ 0 (never tinygemm: the bf16 copy only, so the int4 engine's overhead alone). One
   untimed run per arm and batch, then `--rounds` rounds with the arms rotated.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.fp8_gpu import make_model, rotated, sync
from bench.parts import bench_device, free_memory, mismatch_recipe, mismatch_run, report, run_parts, utc_now
from miles.quant.formats import Format, Scheme

PARTS = ("mismatch", "push", "gemm", "decode")


@dataclass(frozen=True)
class Arm:
    label: str
    quantization: str
    max_rows: int = 4


ARMS = [Arm("bf16", "none"), Arm("int4 @ 4", "int4", 4), Arm("int4 @ 0", "int4", 0)]


def _decoder(model: Path, quantization: str, scheme: Scheme | None, device: str, dtype: torch.dtype):
    from miles.engine.fp8_weights import build_decoder
    from miles.engine.model import ModelSpec

    return build_decoder(ModelSpec.from_dir(model), model, device, dtype, quantization, 1024, scheme)


def _run(sched, arm: Arm, prompts: list[list[int]], new: int, device: str) -> float:
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request

    if arm.quantization == "int4":
        sched.decoder.int4_max_rows = arm.max_rows
    sched.holdings.flush_cache()
    sp = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
    reqs = [Request(str(i), p, sp, i, frozenset()) for i, p in enumerate(prompts)]
    sync(device)
    start = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    sync(device)
    if any(len(r.output) != new for r in reqs):
        raise RuntimeError(f"{arm.label}: a request did not generate {new} tokens")
    return len(reqs) * new / (time.perf_counter() - start)


def decode_models(args) -> list[tuple[str, Path, Scheme]]:
    from bench import moe_gpu

    dtype = "float32" if args.smoke else "bfloat16"
    dense = make_model(Path(args.workdir), "tiny" if args.smoke else "7b", dtype)
    moe_args = argparse.Namespace(smoke=args.smoke, workdir=args.workdir, seed=args.seed)
    moe = moe_gpu.make_model(moe_args, moe_gpu.Model("MoE", "qwen3_moe", args.moe_layers))
    group = 32 if args.smoke else 128
    return [
        ("tiny" if args.smoke else "7B dense", dense, Scheme(Format("int4", group), "linear")),
        ("MoE", moe, Scheme(Format("int4", group), "experts")),
    ]


def decode_part(args, device: str) -> list[dict]:
    from miles.engine.scheduler import Scheduler

    dtype = torch.float32 if args.smoke else torch.bfloat16
    batches = [1, 2] if args.smoke else [1, 32, 256]
    prompt, new = (8, 4) if args.smoke else (128, 128)
    rows = []
    for label, path, scheme in decode_models(args):
        decoders = {
            q: _decoder(path, q, scheme if q == "int4" else None, device, dtype) for q in ("none", "int4")
        }
        scheds = {
            a: Scheduler(decoders[a.quantization], max(batches), max(batches) * (prompt + new) + 4096)
            for a in ARMS
        }
        vocab = decoders["none"].spec.vocab_size
        rng = random.Random(args.seed)

        def prompts(n: int, rng: random.Random = rng, vocab: int = vocab) -> list[list[int]]:
            return [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(n)]

        for b in batches:
            for a in ARMS:  # untimed: graph captures, allocator growth
                _run(scheds[a], a, prompts(b), new, device)
        tok_s = {(b, a): [] for b in batches for a in ARMS}
        for r in range(args.rounds):
            for b in batches:
                batch = prompts(b)
                for a in rotated(ARMS, r):
                    tok_s[(b, a)].append(_run(scheds[a], a, batch, new, device))
                    print(
                        f"decode {label} batch {b} round {r + 1} {a.label}: {tok_s[(b, a)][-1]:.0f} tok/s",
                        flush=True,
                    )
        del scheds, decoders
        free_memory()
        for b in batches:
            ref = tok_s[(b, ARMS[0])]
            for a in ARMS:
                vals = tok_s[(b, a)]
                rows.append(dict(model=label, batch=b, arm=a.label, tok_s=vals,
                                 vs_bf16=[v / x for v, x in zip(vals, ref, strict=True)]))  # fmt: skip
    return rows


def gemm_part(args, device: str) -> list[dict]:
    from miles.engine.packed_weights import int4_gemm_pack
    from miles.quant import int4

    if device != "cuda":
        return [dict(note="tinygemm runs on CUDA only: skipped")]
    rows = []
    for n, k in ((18944, 3584), (3584, 18944)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = int4.quantize(w, 128)
        packed, sz = int4_gemm_pack(int4.pack(q), s.bfloat16(), 128)
        wq = int4.dequantize(q, s, 128, torch.bfloat16)
        for m in (1, 2, 4, 8, 16, 32, 256, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fns = {
                "bf16": lambda x=x, wq=wq: torch.nn.functional.linear(x, wq),
                "int4": lambda x=x, packed=packed, sz=sz: torch.ops.aten._weight_int4pack_mm(
                    x, packed, 128, sz
                ),
            }
            times = {}
            for name, fn in fns.items():
                for _ in range(5):
                    fn()
                samples = []
                for _ in range(50):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    b.synchronize()
                    samples.append(a.elapsed_time(b) * 1000)
                times[name] = statistics.median(samples)
            rows.append(dict(n=n, k=k, m=m, bf16_us=times["bf16"], int4_us=times["int4"],
                             speedup=times["bf16"] / times["int4"]))  # fmt: skip
            print(f"gemm {n}x{k} m={m}: bf16 {times['bf16']:.1f} us, int4 {times['int4']:.1f} us", flush=True)
    return rows


def push_part(args, device: str) -> list[dict]:
    from miles.engine.model import ModelSpec, load_weights
    from miles.train.quant import export_pairs

    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows = []
    for size in ["tiny"] if args.smoke else ["0.5b", "7b"]:
        path = make_model(Path(args.workdir), size, str(dtype).removeprefix("torch."))
        scheme = Scheme(Format("int4", 32 if args.smoke else 128), "linear")
        host = load_weights(path)
        named = {n: t.to(device) for n, t in host.items()}
        del host
        engines = {
            "bf16": _decoder(path, "none", None, device, dtype),
            "int4": _decoder(path, "int4", scheme, device, dtype),
        }
        result = dict(size=size)
        for label, contract in (("bf16", None), ("int4", scheme)):
            times, sent = [], 0
            for _ in range(max(args.rounds, 2)):
                sync(device)
                start = time.perf_counter()
                parts = dict(export_pairs(named.items(), contract))
                engines[label].load(parts)
                sync(device)
                times.append(time.perf_counter() - start)
                sent = sum(t.numel() * t.element_size() for t in parts.values())
                del parts
            result[f"{label}_bytes"], result[f"{label}_s"] = sent, times
            print(
                f"push {size} {label}: {sent / 2**20:.0f} MiB, {statistics.median(times):.3f} s", flush=True
            )
        spec = ModelSpec.from_dir(path)
        del engines, named, spec
        free_memory()
        rows.append(result)
    return rows


def mismatch_part(args, device: str) -> list[dict]:
    dtype = "float32" if args.smoke else "bfloat16"
    model = make_model(Path(args.workdir), "tiny" if args.smoke else "0.5b", dtype)
    loss = {"old_logprobs": "recompute", "kl_coef": 0.0, "tis": "truncate", "tis_clip": 2.0}
    recipe = mismatch_recipe(args, model, "int4-mismatch", args.mm_backend, args.mm_steps, loss)
    group = 32 if args.smoke else 128
    int4 = [
        "engine.quantization=int4",
        "engine.quant_modules=linear",
        f"engine.int4_group_size={group}",
        "weights.check=true",
    ]
    arms = [
        ("bf16 engine, bf16 trainer", ["engine.quantization=none", "train.quantization=none"]),
        ("int4 engine, trainer without the contract", [*int4, "train.quantization=none"]),
        ("int4 engine, trainer with the contract (int4_qat)", [*int4, "train.quantization=int4_qat"]),
    ]
    keys = {"mismatch": "train/logprob_mismatch", "checksum_mismatch": "weights/checksum_mismatch",
            "push_s": "weights/push_s", "push_bytes": "weights/push_bytes"}  # fmt: skip
    return [
        dict(label=label, overrides=sets)
        | mismatch_run(recipe, args.workdir, f"int4-mismatch-{k}", sets, args.mm_steps, keys)
        for k, (label, sets) in enumerate(arms)
    ]


# ---- tables -----------------------------------------------------------------------------------------


def _range(vals: list[float], fmt: str = "{:.2f}") -> str:
    return fmt.format(min(vals)) if len(vals) == 1 else f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"


def decode_table(rows: list[dict]) -> list[str]:
    out = ["| model | batch | engine | tok/s (min-max) | vs bf16 (min-max) |", "|---|---:|---|---:|---:|"]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['batch']} | {r['arm']} | {_range(r['tok_s'], '{:.0f}')} | {_range(r['vs_bf16'])} |"
        )
    return out


def gemm_table(rows: list[dict]) -> list[str]:
    if rows and "note" in rows[0]:
        return [rows[0]["note"]]
    out = ["| out x in | rows | bf16 us | int4 us | int4 speed-up |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(
            f"| {r['n']} x {r['k']} | {r['m']} | {r['bf16_us']:.1f} | {r['int4_us']:.1f} | {r['speedup']:.2f} |"
        )
    return out


def push_table(rows: list[dict]) -> list[str]:
    out = ["| shapes | bf16 MiB | int4 MiB | bytes ratio | bf16 load s | int4 quantise + load s |",
           "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['size']} | {r['bf16_bytes'] / 2**20:.0f} | {r['int4_bytes'] / 2**20:.0f} | "
            f"{r['bf16_bytes'] / r['int4_bytes']:.2f} | {_range(r['bf16_s'], '{:.3f}')} | {_range(r['int4_s'], '{:.3f}')} |"
        )
    return out


def mismatch_table(rows: list[dict]) -> list[str]:
    out = ["| run | mismatch mean | mismatch per step | checksum mismatches | push s (median) | push MiB |",
           "|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['label']} | failed: {r['failed']} | | | | |")
            continue
        mm = r["mismatch"]
        per = " ".join(f"{v:.4f}" for v in mm)
        cs = int(sum(r.get("checksum_mismatch") or [0]))
        push = statistics.median(r["push_s"]) if r.get("push_s") else float("nan")
        mib = (r["push_bytes"][-1] / 2**20) if r.get("push_bytes") else float("nan")
        out.append(f"| {r['label']} | {statistics.mean(mm):.4f} | {per} | {cs} | {push:.3f} | {mib:.0f} |")
    out += ["", "Commands:"] + [f"    {r['command']}" for r in rows]
    return out


def header(args, device: str, start: str, end: str) -> list[str]:
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return [
        f"bench.int4_gpu, {start} - {end} UTC, torch {torch.__version__}, CUDA {torch.version.cuda}, {gpu}",
        "",
        "    python -m bench.int4_gpu " + " ".join(sys.argv[1:]),
        "",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", action="append", choices=PARTS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--moe-layers", type=int, default=12)
    p.add_argument("--mm-steps", type=int, default=20)
    p.add_argument("--mm-backend", choices=["fsdp", "megatron"], default="fsdp")
    p.add_argument("--mm-prompts", type=int, default=16)
    p.add_argument("--mm-samples", type=int, default=8)
    p.add_argument("--mm-prompt", type=int, default=128)
    p.add_argument("--mm-completion", type=int, default=256)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="runs/bench_int4")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.mm_steps, args.moe_layers = 1, 2, 2
        args.mm_prompts, args.mm_samples, args.mm_prompt, args.mm_completion, args.micro_tokens = (
            2,
            2,
            8,
            4,
            512,
        )
    args.workdir = str(Path(args.workdir).resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, start = bench_device(args, "bench.int4_gpu"), utc_now()
    runners = {
        "mismatch": lambda: mismatch_part(args, device),
        "push": lambda: push_part(args, device),
        "gemm": lambda: gemm_part(args, device),
        "decode": lambda: decode_part(args, device),
    }
    results, errors = run_parts(args, PARTS, runners)
    sections = [
        (
            "mismatch",
            "Train-rollout log-prob mismatch: bf16 vs int4 engine without / with the contract",
            mismatch_table,
        ),
        ("push", "Weight push in process: bytes and quantise + load time", push_table),
        ("gemm", "One linear layer: tinygemm W4A16 vs bf16", gemm_table),
        ("decode", "Decode: embedded engine in process, CUDA graphs", decode_table),
    ]
    return report(args, header(args, device, start, utc_now()), sections, results, errors)


if __name__ == "__main__":
    sys.exit(main())
