"""FP8 against bf16 on one GPU, in one run: rollout tok/s, train step time, train-rollout log-prob mismatch.

    python -m bench.fp8_gpu [--part rollout|train|mismatch ...] [--sizes 0.5b 7b] [--rounds 3] [--out F.json]
    python -m bench.fp8_gpu --smoke      # CPU, tiny model, 2 rounds / 2 steps: the plumbing, not figures

Parts (`--part`, repeatable; all three by default), run in the order mismatch, train, rollout, so that
the `miles train` child processes of the first find the GPU empty:

1. rollout: the embedded engine in this process (the Scheduler stepped in this thread, CUDA graphs,
   temperature 1, ignore_eos) on random-init models of Qwen2.5-0.5B and Qwen2.5-7B shapes (bf16
   safetensors written from the config here; nothing is downloaded). Arms: engine.quantization none
   (bf16), fp8_block and fp8_row, each FP8 layout at engine.fp8_min_tokens' default and at 1 (every
   GEMM in FP8, decode included; 1 is the lowest value the key takes; the two arms of a layout share
   its weights). Workloads: decode-heavy (256 requests, prompt 128, 512 new tokens) and prefill-heavy
   (64 requests, prompt 2048, 8 new tokens). The arms run one after another, each with a KV pool of
   its own that is freed before the next, and each layout's decoder is built before its arms and freed
   after them (five pools beside the three 7B decoders, or one pool beside them, did not fit an 80 GB
   card): each workload once untimed (graph captures, Triton compiles), then each round each
   workload, with fresh random prompts per round (the same for every arm).
2. train: the FSDP backend on one GPU with bench/gpu_train.py's shapes and batch (Qwen2.5-0.5B, 64 x
   1024 tokens, 8192-token micro-batches), train.quantization none / fake_quant (layout --layout) /
   torchao_float8 (skipped, the reason printed, without torchao or a GPU). One untimed step per arm,
   then per round `--train-steps` steps per arm, arms rotated per round.
3. mismatch: `miles train` with bench/e2e_gpu.py's colocated synchronous GRPO recipe on the 0.5B shapes
   (fixed seed, 16 prompts x 8 samples, prompt 128, 256 new tokens, old log-probs recomputed, TIS
   truncate at 2), 20 steps each of: bf16 engine + bf16 trainer; FP8 engine (--layout) + trainer
   without the contract (train.quantization=none: a bf16 forward, so the mismatch holds the whole
   weight quantisation error; the engine serves the contract's bytes of the trainer's weights either
   way); FP8 engine + trainer with the contract (fake_quant). FP8 runs check after every push that
   the engine's bytes equal the trainer's (weights.check). train/logprob_mismatch from metrics.jsonl.

The table printed at the end is markdown for bench/RESULTS.md: command, UTC times, torch / CUDA / GPU,
the definition of every figure and ratio, one row per arm. `--out` keeps the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu_train import samples as train_samples
from bench.parts import (
    bench_device,
    free_memory,
    mismatch_recipe,
    mismatch_run,
    report,
    run_parts,
    utc_now,
)
from miles.models.tiny import QWEN25_05B_SHAPE, QWEN25_VOCAB, init_random

REPO = Path(__file__).resolve().parents[1]
QWEN25_7B_SHAPE = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
)
TINY_SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
)
# name -> (shape, vocab, tied embeddings); the tiny model keeps Qwen's vocabulary so that the helpers
# of bench/gpu_train.py and bench/e2e_gpu.py (token ids up to 151k) serve it unchanged
SIZES = {
    "0.5b": (QWEN25_05B_SHAPE, QWEN25_VOCAB, True),
    "7b": (QWEN25_7B_SHAPE, 152064, False),
    "tiny": (TINY_SHAPE, QWEN25_VOCAB, True),
}
PARTS = ("mismatch", "train", "rollout")


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    prompt: int
    completion: int
    count_prompt: bool
    """tok/s counts prompt + generated tokens (prefill-heavy) or generated tokens only (decode-heavy)."""


@dataclass(frozen=True)
class Arm:
    quantization: str
    min_tokens: int | None
    """engine.fp8_min_tokens (None: bf16)."""

    @property
    def label(self) -> str:
        return "bf16" if self.min_tokens is None else f"{self.quantization} @ {self.min_tokens}"


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        return [Workload("decode", 4, 8, 4, False), Workload("prefill", 2, 32, 1, True)]
    return [Workload("decode", 256, 128, 512, False), Workload("prefill", 64, 2048, 8, True)]


def rollout_arms() -> list[Arm]:
    from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS as D

    return [Arm("none", None), Arm("fp8_block", D), Arm("fp8_block", 1), Arm("fp8_row", D), Arm("fp8_row", 1)]


def rotated(items: list, r: int) -> list:
    k = r % len(items)
    return items[k:] + items[:k]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_model(work: Path, size: str, dtype: str) -> Path:
    """The random-init model of `size` under `work` (written once, reused by later runs)."""
    shape, vocab, tied = SIZES[size]
    out = work / f"model-{size}-{dtype}"
    if not (out / "config.json").exists():
        init_random(out, shape=shape, vocab_size=vocab, tie_word_embeddings=tied, dtype=dtype)
        free_memory()
    return out


# ---- part 1: rollout tok/s -------------------------------------------------------------------------


def build_decoders(model: Path, arms: list[Arm], device: str, dtype: torch.dtype) -> dict:
    """One decoder per quantization of `arms` (the arms of one FP8 layout share it; min_tokens is set
    per run)."""
    from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
    from miles.engine.model import ModelSpec

    spec = ModelSpec.from_dir(model)
    return {
        q: build_decoder(spec, model, device, dtype, q, DEFAULT_FP8_MIN_TOKENS)
        for q in dict.fromkeys(a.quantization for a in arms)
    }


def build_engines(model: Path, arms: list[Arm], loads: list[Workload], device: str, dtype: torch.dtype):
    """One Scheduler per arm, all alive at once (bench/moe_gpu.py's arms, one per model)."""
    decoders = build_decoders(model, arms, device, dtype)
    return {a: scheduler_for(decoders[a.quantization], loads) for a in arms}


def scheduler_for(decoder, loads: list[Workload]):
    """A Scheduler over `decoder` with room for the largest workload (its own KV pool)."""
    from miles.engine.scheduler import Scheduler

    width = max(w.requests for w in loads)
    slots = max(w.requests * (w.prompt + w.completion) for w in loads) + 4096
    return Scheduler(decoder, width, slots)


def engine_run(sched, arm: Arm, prompts: list[list[int]], w: Workload, device: str) -> float:
    """tok/s of one batch of `prompts` through `sched` (Workload.count_prompt says which tokens count)."""
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request

    if arm.min_tokens is not None:
        sched.decoder.min_tokens = arm.min_tokens
    sched.holdings.flush_cache()
    sp = SamplingParams(max_new_tokens=w.completion, temperature=1.0, ignore_eos=True)
    reqs = [Request(str(i), p, sp, i, frozenset()) for i, p in enumerate(prompts)]
    sync(device)
    start = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    sync(device)
    wall = time.perf_counter() - start
    if any(len(r.output) != w.completion for r in reqs):
        raise RuntimeError(f"{arm.label} {w.name}: a request did not generate {w.completion} tokens")
    return w.requests * (w.completion + (w.prompt if w.count_prompt else 0)) / wall


def rollout_size(args, size: str, device: str) -> list[dict]:
    """Every arm x workload of one model size, `args.rounds` rounds; one result row per arm x workload."""
    dtype = "float32" if args.smoke else "bfloat16"
    model = make_model(Path(args.workdir), size, dtype)
    arms, loads = rollout_arms(), workloads(args.smoke)
    vocab = SIZES[size][1]

    def prompts(w: Workload, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(vocab) for _ in range(w.prompt)] for _ in range(w.requests)]

    tok_s: dict[tuple[str, Arm], list[float]] = {(w.name, a): [] for w in loads for a in arms}
    for q in dict.fromkeys(a.quantization for a in arms):  # one decoder and one KV pool at a time: the
        decoder = build_decoders(model, [Arm(q, None)], device, getattr(torch, dtype))[q]  # 7B's three
        for a in (a for a in arms if a.quantization == q):  # decoders with their pools overflow 80 GB
            sched = scheduler_for(decoder, loads)
            for w in loads:  # untimed: graph captures, Triton compiles, allocator growth
                engine_run(sched, a, prompts(w, 10_000), w, device)
            for r in range(args.rounds):
                for w in loads:
                    tok_s[(w.name, a)].append(engine_run(sched, a, prompts(w, r), w, device))
                    print(
                        f"rollout {size} {w.name} round {r + 1} {a.label}: {tok_s[(w.name, a)][-1]:.0f} tok/s"
                    )
            del sched
            free_memory()
        del decoder
        free_memory()
    refused = block_gemm_refused()
    rows = []
    for w in loads:
        ref = tok_s[(w.name, arms[0])]
        for a in arms:
            vals = tok_s[(w.name, a)]
            speedup = [v / b for v, b in zip(vals, ref, strict=True)]
            rows.append(dict(size=size, workload=w.name, workload_shape=vars(w), arm=a.label,
                             quantization=a.quantization, min_tokens=a.min_tokens, tok_s=vals,
                             speedup=speedup, block_gemm_refused=refused))  # fmt: skip
    return rows


def block_gemm_refused() -> bool:
    """Whether this torch / cuBLASLt refused the blockwise FP8 GEMM (fp8_block then ran dequantised)."""
    if not torch.cuda.is_available():
        return False
    from miles.quant import triton_fp8

    return bool(triton_fp8._BLOCK_MM_REFUSED)


# ---- part 2: train step time -----------------------------------------------------------------------


def train_backend(args, model: Path, quantization: str, device: str, dtype: str):
    from miles.config import Plan
    from miles.train import get_backend

    data = {
        "model": {"path": str(model), "dtype": dtype},
        "train": {
            "backend": "fsdp",
            "lr": 1e-6,
            "max_tokens_per_microbatch": args.micro_tokens,
            "device": device,
            "quantization": quantization,
        },
        "run": {"runs_root": str(Path(args.workdir) / "runs"), "seed": args.seed},
    }
    if quantization == "fake_quant":
        data["engine"] = {"quantization": args.layout}
    backend = get_backend("fsdp")()
    backend.setup(Plan.model_validate(data))
    return backend


def train_arms(args, model: Path, batch, device: str, dtype: str) -> tuple[dict, dict[str, str]]:
    """The backends of the arms that run (each after one untimed step), and why the others do not."""
    backends, skipped = {}, {}
    for q in ("none", "fake_quant", "torchao_float8"):
        if q == "torchao_float8" and device != "cuda":
            skipped[q] = "train.quantization=torchao_float8 runs on CUDA only (this run is on the CPU)"
        elif q == "torchao_float8" and importlib.util.find_spec("torchao") is None:
            skipped[q] = "torchao is not importable (pip install 'miles[torchao]')"
        else:
            try:
                backends[q] = train_backend(args, model, q, device, dtype)
                backends[q].train(batch)  # untimed: compiles, allocator growth
            except Exception as exc:  # an optional arm that fails is reported, the others still run
                if q != "torchao_float8":
                    raise
                backends.pop(q, None)
                skipped[q] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return backends, skipped


def train_part(args, device: str) -> list[dict]:
    """Step seconds per arm and round (mean of `args.train_steps` steps), speed-up vs bf16 per round."""
    dtype = "float32" if args.smoke else "bfloat16"
    model = make_model(Path(args.workdir), "tiny" if args.smoke else "0.5b", dtype)
    batch = train_samples(args.train_batch, args.train_seq, args.train_prompt, seed=args.seed)
    backends, skipped = train_arms(args, model, batch, device, dtype)
    step_s: dict[str, list[float]] = {q: [] for q in backends}
    for r in range(args.rounds):
        for q in rotated(list(backends), r):
            times = []
            for _ in range(args.train_steps):
                sync(device)
                start = time.perf_counter()
                backends[q].train(batch)
                sync(device)
                times.append(time.perf_counter() - start)
            step_s[q].append(statistics.mean(times))
            print(f"train round {r + 1} {q}: {step_s[q][-1]:.3f} s/step")
    del backends
    free_memory()
    rows = []
    for q, v in step_s.items():
        rows.append(
            dict(quantization=q, step_s=v, speedup=[b / x for x, b in zip(v, step_s["none"], strict=True)])
        )
    return rows + [dict(quantization=q, skipped=why) for q, why in skipped.items()]


# ---- part 3: log-prob mismatch over GRPO steps -----------------------------------------------------


def mismatch_arms(layout: str) -> list[tuple[str, list[str]]]:
    """(label, overrides) of the three runs."""
    return [
        ("bf16 engine, bf16 trainer", ["engine.quantization=none", "train.quantization=none"]),
        (f"{layout} engine, trainer without the contract",
         [f"engine.quantization={layout}", "train.quantization=none", "weights.check=true"]),
        (f"{layout} engine, trainer with the contract",
         [f"engine.quantization={layout}", "train.quantization=fake_quant", "weights.check=true"]),
    ]  # fmt: skip


def mismatch_part(args, device: str) -> list[dict]:
    """Three `miles train` runs of the same recipe; per-step train/logprob_mismatch from metrics.jsonl."""
    dtype = "float32" if args.smoke else "bfloat16"
    model = make_model(Path(args.workdir), "tiny" if args.smoke else "0.5b", dtype)
    loss = {"old_logprobs": "recompute", "kl_coef": 0.0, "tis": "truncate", "tis_clip": 2.0}
    recipe = mismatch_recipe(args, model, "fp8-mismatch", args.mm_backend, args.mm_steps, loss)
    keys = {"mismatch": "train/logprob_mismatch", "tis_clip_frac": "train/tis_clip_frac",
            "checksum_mismatch": "weights/checksum_mismatch"}  # fmt: skip
    return [
        dict(label=label, overrides=sets)
        | mismatch_run(recipe, args.workdir, f"fp8-mismatch-{k}", sets, args.mm_steps, keys)
        for k, (label, sets) in enumerate(mismatch_arms(args.layout))
    ]


# ---- the table -------------------------------------------------------------------------------------


def versions(device: str) -> str:
    import transformers

    try:
        import triton

        tri = f", triton {triton.__version__}"
    except ImportError:
        tri = ""
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    return f"device: {where}; torch {torch.__version__}{cuda}, transformers {transformers.__version__}{tri}"


def code_version() -> str:
    def git(*a: str) -> str | None:
        try:
            p = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return "code: not a git checkout"
    return f"code: commit {head}" + (" + uncommitted changes" if git("status", "--porcelain") else "")


def span(vals: list[float], fmt) -> str:
    lo, hi = min(vals), max(vals)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def tok(v: float) -> str:
    return f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:.0f}"


RATIO, SCI = "{:.2f}x".format, "{:.3e}".format


def verdict(speedup: list[float]) -> str:
    if max(speedup) < 1:
        return "slower than bf16"
    if min(speedup) > 1:
        return "faster than bf16"
    return "not resolved (range spans 1)"


MODEL_NAMES = {"0.5b": "Qwen2.5-0.5B shapes", "7b": "Qwen2.5-7B shapes", "tiny": "tiny (smoke)"}


def header(args, device: str, start: str, end: str) -> list[str]:
    w = {x.name: x for x in workloads(args.smoke)}
    d, p = w["decode"], w["prefill"]
    return [
        f"### FP8 vs bf16 on one GPU: rollout, training, train-rollout mismatch ({start} - {end} UTC)",
        "",
        f"    python -m bench.fp8_gpu {' '.join(sys.argv[1:])}".rstrip(),
        "",
        f"{versions(device)}; {code_version()}.",
        "",
        f"- rollout tok/s: decode-heavy ({d.requests} requests, prompt {d.prompt}, {d.completion} new tokens) "
        "= generated tokens / wall seconds from submitting the batch to its last token (prefill included, "
        f"graphs captured before); prefill-heavy ({p.requests} requests, prompt {p.prompt}, {p.completion} new "
        "tokens) = (prompt + generated tokens) / the same wall seconds. Range = min-max over "
        f"{args.rounds} rounds.",
        "- rollout speed-up = FP8 arm tok/s / bf16 tok/s, same round, model and workload (> 1: FP8 faster). "
        "`@ N` is engine.fp8_min_tokens: GEMMs with fewer than N rows multiply the engine's bf16 copy of "
        "the weight; `@ 1` runs every GEMM in FP8 (decode included) and keeps no copy.",
        f"- train step s = mean of {args.train_steps} steps of one round; train speed-up = bf16 step s / "
        "arm step s, same round (> 1: arm faster).",
        "- verdict: slower / faster than bf16 when every round's speed-up is below / above 1.",
        "- mismatch = train/logprob_mismatch: mean over the step's response tokens of |logp_train - "
        "logp_rollout| (the trainer's recomputed log-prob before the step's update vs the engine's "
        f"sampling log-prob); mean = over the {args.mm_steps} steps; ratio = run mean / bf16 run mean.",
        "",
    ]


def rollout_table(rows: list[dict]) -> list[str]:
    out = [
        "| model | workload | engine @ fp8_min_tokens | tok/s (min-max) | speed-up vs bf16 (min-max) | verdict |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        ref = r["min_tokens"] is None
        out.append(
            f"| {MODEL_NAMES[r['size']]} | {r['workload']} | {r['arm']} | {span(r['tok_s'], tok)} | "
            f"{'1' if ref else span(r['speedup'], RATIO)} | {'reference' if ref else verdict(r['speedup'])} |"
        )
    if any(r["block_gemm_refused"] for r in rows):
        out.append("")
        out.append(
            "fp8_block: this torch / cuBLASLt refused the blockwise FP8 GEMM; its GEMMs ran dequantised."
        )
    return out


def train_table(rows: list[dict], args) -> list[str]:
    model = "tiny (smoke)" if args.smoke else "Qwen2.5-0.5B shapes"
    out = [
        f"FSDP, one device, {model}, {args.train_batch} x {args.train_seq} tokens, micro-batch "
        f"{args.micro_tokens} tokens; fake_quant with layout {args.layout}:",
        "",
        "| train.quantization | step s (min-max) | speed-up vs bf16 (min-max) | verdict |",
        "|---|---:|---:|---|",
    ]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['quantization']} | skipped: {r['skipped']} | | |")
            continue
        ref = r["quantization"] == "none"
        fmt = lambda v: f"{v:.3f}"  # noqa: E731
        out.append(
            f"| {r['quantization']} | {span(r['step_s'], fmt)} | {'1' if ref else span(r['speedup'], RATIO)} | "
            f"{'reference' if ref else verdict(r['speedup'])} |"
        )
    return out


def mismatch_table(rows: list[dict], args) -> list[str]:
    model = "tiny (smoke)" if args.smoke else "Qwen2.5-0.5B shapes"
    out = [
        f"{args.mm_steps} GRPO steps, {model}, seed {args.seed}, train.backend={args.mm_backend}:",
        "",
        "| run | overrides | mismatch mean | per step (min-max) | ratio to bf16 | TIS clip frac mean | "
        "tensors whose engine bytes differed (checks) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    means = [statistics.mean(r["mismatch"]) if r["mismatch"] and "failed" not in r else None for r in rows]
    for r, mean in zip(rows, means, strict=True):
        sets = " ".join(f"`{s}`" for s in r["overrides"])
        if mean is None:
            out.append(f"| {r['label']} | {sets} | failed: {r.get('failed', 'no steps')} | | | | |")
            continue
        rel = f"{mean / means[0]:.2f}x" if means[0] else "-"
        clip = f"{statistics.mean(r['tis_clip_frac']):.4f}" if r["tis_clip_frac"] else "-"
        n = r["checksum_mismatch"]
        checks = f"{sum(n):.0f} ({len(n)})" if n else "-"
        out.append(
            f"| {r['label']} | {sets} | {SCI(mean)} | {span(r['mismatch'], SCI)} | {rel} | {clip} | {checks} |"
        )
    out += ["", "| step | " + " | ".join(r["label"] for r in rows) + " |", "|---:" * (len(rows) + 1) + "|"]
    for s in range(max(len(r["mismatch"]) for r in rows)):
        vals = [SCI(r["mismatch"][s]) if s < len(r["mismatch"]) else "-" for r in rows]
        out.append(f"| {s + 1} | " + " | ".join(vals) + " |")
    if means[1] is not None and means[2] is not None:
        lower = "lower" if means[2] < means[1] else "NOT lower"
        out += [
            "",
            f"With the contract the FP8 mismatch is {lower} than without it: {SCI(means[2])} vs {SCI(means[1])}.",
        ]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--part", action="append", choices=PARTS, help="run only this part (repeatable; default all)"
    )
    p.add_argument(
        "--sizes", nargs="+", choices=["0.5b", "7b"], default=["0.5b", "7b"], help="rollout model sizes"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of the rollout and train parts (>= 1)")
    p.add_argument("--layout", choices=["fp8_block", "fp8_row"], default="fp8_block",
                   help="engine.quantization of the mismatch runs and the fake_quant trainer")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-steps", type=int, default=2, help="timed train steps per arm and round")
    p.add_argument("--train-batch", type=int, default=64)
    p.add_argument("--train-seq", type=int, default=1024)
    p.add_argument("--train-prompt", type=int, default=128)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--mm-steps", type=int, default=20, help="GRPO steps of each mismatch run")
    p.add_argument("--mm-prompts", type=int, default=16)
    p.add_argument("--mm-samples", type=int, default=8)
    p.add_argument("--mm-prompt", type=int, default=128)
    p.add_argument("--mm-completion", type=int, default=256)
    p.add_argument("--mm-backend", choices=["fsdp", "megatron"], default="fsdp")
    p.add_argument("--workdir", default="runs/bench_fp8", help="models, recipes and run directories")
    p.add_argument("--out", default=None, help="JSON file for the raw numbers")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, small sizes: checks the plumbing")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.rounds, args.train_steps = ["tiny"], 2, 1
        args.train_batch, args.train_seq, args.train_prompt, args.micro_tokens = 4, 24, 8, 512
        args.mm_steps, args.mm_prompts, args.mm_samples, args.mm_prompt, args.mm_completion = 2, 2, 2, 8, 4
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.workdir = str(Path(args.workdir).resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, start = bench_device(args, "bench.fp8_gpu"), utc_now()
    runners = {
        "mismatch": lambda: mismatch_part(args, device),
        "train": lambda: train_part(args, device),
        "rollout": lambda: [row for size in args.sizes for row in rollout_size(args, size, device)],
    }
    results, errors = run_parts(args, PARTS, runners)
    sections = [
        ("rollout", "Rollout: embedded engine in process, CUDA graphs", rollout_table),
        ("train", "Train step", lambda r: train_table(r, args)),
        ("mismatch", "Train-rollout log-prob mismatch", lambda r: mismatch_table(r, args)),
    ]
    return report(args, header(args, device, start, utc_now()), sections, results, errors)


if __name__ == "__main__":
    sys.exit(main())
