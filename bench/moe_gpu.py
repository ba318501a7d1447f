"""Mixture-of-experts on one GPU, in one run: decode tok/s against a dense model, mismatch with and without R3.

    python -m bench.moe_gpu [--part decode|mismatch ...] [--rounds 3] [--steps 20] [--layers 12] [--out F.json]
    python -m bench.moe_gpu --smoke      # CPU, tiny MoE, 2 rounds / 2 steps: the plumbing, not figures

Parts (`--part`, repeatable; both by default), run in the order mismatch, decode, so that the
`miles train` child processes of the first find the GPU empty:

1. decode: the embedded engine in this process (bench/fp8_gpu.py's in-process Scheduler, CUDA graphs,
   temperature 1, ignore_eos, bf16) on two random-init models (safetensors written here, nothing
   downloaded): a Qwen3-MoE of Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads of
   128, 128 experts top-8 renormalised, expert intermediate 768, every layer sparse, Qwen's 151,936-token
   vocabulary, untied head) cut to `--layers` layers, and the dense Qwen3 of the same active parameters
   per token: same attention, embeddings and layer count, MLP intermediate = top-k x expert intermediate
   (8 x 768 = 6144). Workloads: decode-heavy (256 requests, prompt 128, 256 new tokens) and small batch
   (32 requests, same lengths). Each model runs each workload once untimed (graph captures, allocator
   growth); then each round runs each workload on both models, their order swapped every round, with
   fresh random prompts per round (the same for both).
2. mismatch: `miles train` on the FSDP backend with bench/e2e_gpu.py's colocated synchronous GRPO recipe
   (as bench/fp8_gpu.py's mismatch part: fixed seed, 16 prompts x 8 samples of random tokens, prompt 128,
   128 new tokens, old log-probs recomputed, lr 1e-6), `--steps` steps each with train.routing_replay
   off and rollout (R3: the trainer routes every token through the experts the engine chose). The model
   is part 1's router and attention layout at half width (hidden 1024, 16 / 4 heads of 64, 128 experts
   top-8 renormalised, expert intermediate 384; `--mm-layers` layers, 0.93B parameters at 4): every run
   ends with a checkpoint of fp32 weights and AdamW state (12 bytes a parameter, written and hashed, then
   removed here), which part 1's 16 GB model would turn into minutes and most of the disk. From each
   run's metrics.jsonl: train/logprob_mismatch, train/router_agreement and train/router_natural_agreement.

Estimated wall time on one H200, models not yet written: mismatch about 3 minutes (two runs of about
40 s start-up, 20 steps of 2-4 s and a 11 GB checkpoint), decode about 2 minutes (writing and loading
16 GB of MoE weights, graph captures, 16 batches of 1-5 s); about 5 minutes in all, less when the
models are already in `--workdir`. The table printed at the end is markdown for bench/RESULTS.md: command, UTC times, torch /
CUDA / GPU, the definition of every figure. `--out` keeps the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.fp8_gpu import (
    SCI,
    Workload,
    build_engines,
    code_version,
    engine_run,
    rotated,
    span,
    tok,
    versions,
)
from bench.parts import (
    bench_device,
    free_memory,
    mismatch_recipe,
    mismatch_run,
    report,
    run_parts,
    utc_now,
)
from miles.models.tiny import QWEN25_VOCAB, init_random

# Qwen3-30B-A3B's layer shapes (its vocabulary is Qwen2.5's 151,936 ids); the layer count is --layers
QWEN3_30B_A3B_LAYER = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    mlp_only_layers=[],
)
# the same router (128 experts, top-8, renormalised) at half width: the mismatch part trains it, and every
# run ends with a checkpoint of fp32 weights and AdamW state (12 bytes a parameter, written and hashed)
A3B_HALF_LAYER = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=384,
    mlp_only_layers=[],
)
TINY_LAYER = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=[],
)
LAYERS = {"a3b": QWEN3_30B_A3B_LAYER, "a3b-half": A3B_HALF_LAYER}
ATTENTION_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
PARTS = ("mismatch", "decode")


@dataclass(frozen=True)
class Model:
    """One model of the comparison; `quantization` and `min_tokens` are what bench/fp8_gpu.py's
    build_engines / engine_run read of an arm: a bf16 engine here."""

    label: str
    arch: str
    layers: int
    layer: str = "a3b"
    """Key of LAYERS: the per-layer shapes (the tiny ones in --smoke)."""
    quantization: str = "none"
    min_tokens: None = None
    experts: str = "fused"
    """miles/engine/moe.py's CUDA_PATH while this arm runs (an MoE's expert kernels)."""

    def shape(self, smoke: bool) -> dict:
        layer = TINY_LAYER if smoke else LAYERS[self.layer]
        if self.arch == "qwen3_moe":
            return layer | {"num_hidden_layers": self.layers}
        inter = layer["num_experts_per_tok"] * layer["moe_intermediate_size"]
        return {k: layer[k] for k in ATTENTION_KEYS} | {
            "num_hidden_layers": self.layers,
            "intermediate_size": inter,
        }


def decode_models(layers: int, grouped: bool) -> list[Model]:
    """The MoE (fused expert kernels), the dense model of the same active size, and with `grouped`
    the MoE through torch._grouped_mm (the fused kernels' anchor)."""
    models = [Model("MoE", "qwen3_moe", layers), Model("dense, same active", "qwen3", layers)]
    return models + ([Model("MoE, grouped GEMM", "qwen3_moe", layers, experts="grouped")] if grouped else [])


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        return [Workload("decode-heavy", 4, 8, 4, False), Workload("small batch", 2, 8, 4, False)]
    return [Workload("decode-heavy", 256, 128, 256, False), Workload("small batch", 32, 128, 256, False)]


def make_model(args, m: Model) -> Path:
    """The random-init model `m` under --workdir (written once, reused by later runs)."""
    dtype = "float32" if args.smoke else "bfloat16"
    out = Path(args.workdir) / f"model-{m.arch}-{'tiny' if args.smoke else m.layer}-L{m.layers}-{dtype}"
    if not (out / "config.json").exists():
        init_random(out, shape=m.shape(args.smoke), vocab_size=QWEN25_VOCAB, tie_word_embeddings=False,
                    dtype=dtype, seed=args.seed, arch=m.arch)  # fmt: skip
        free_memory()
    return out


def param_counts(model_dir: Path) -> dict[str, int]:
    """Total parameters in the checkpoint and those one token uses (k of E experts per MoE layer);
    embeddings and LM head included in both."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    total = experts = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                n = math.prod(st.get_slice(name).get_shape())
                total += n
                experts += n if ".mlp.experts." in name else 0
    num = cfg.get("num_experts") or cfg.get("num_local_experts")
    if num and not experts:
        raise RuntimeError(f"{model_dir} has {num} experts per MoE layer but no mlp.experts.* tensors")
    active = total - experts + (experts * cfg["num_experts_per_tok"] // num if num else 0)
    return dict(total=total, active=active)


# ---- part 1: decode tok/s --------------------------------------------------------------------------


def decode_part(args, device: str) -> list[dict]:
    """tok/s of both models on both workloads over `args.rounds` rounds; one row per model x workload."""
    from miles.engine import moe

    dtype = torch.float32 if args.smoke else torch.bfloat16
    models, loads = decode_models(args.layers, args.grouped), workloads(args.smoke)
    paths = {m: make_model(args, m) for m in models}
    engines = {m: build_engines(paths[m], [m], loads, device, dtype)[m] for m in models}

    def run(m: Model, batch: list[list[int]], w: Workload, engines=engines) -> float:
        moe.CUDA_PATH = m.experts  # the expert path while this arm prefills and captures its graphs
        return engine_run(engines[m], m, batch, w, device)

    def prompts(w: Workload, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(QWEN25_VOCAB) for _ in range(w.prompt)] for _ in range(w.requests)]

    for w in loads:
        for m in models:  # untimed: graph captures, allocator growth
            run(m, prompts(w, 10_000), w)
    tok_s: dict[tuple[str, Model], list[float]] = {(w.name, m): [] for w in loads for m in models}
    for r in range(args.rounds):
        for w in loads:
            batch = prompts(w, r)
            for m in rotated(models, r):
                tok_s[(w.name, m)].append(run(m, batch, w))
                print(
                    f"decode {w.name} round {r + 1} {m.label}: {tok_s[(w.name, m)][-1]:.0f} tok/s", flush=True
                )
    del engines, run
    free_memory()
    rows = []
    for w in loads:
        dense = tok_s[(w.name, models[1])]
        for m in models:
            vals = tok_s[(w.name, m)]
            rows.append(dict(model=m.label, arch=m.arch, layers=m.layers, shape=m.shape(args.smoke),
                             params=param_counts(paths[m]), workload=w.name, workload_shape=vars(w),
                             tok_s=vals, vs_dense=[v / d for v, d in zip(vals, dense, strict=True)]))  # fmt: skip
    return rows


# ---- part 2: log-prob mismatch with and without routing replay -------------------------------------


def mismatch_part(args, device: str) -> list[dict]:
    """Two `miles train` runs of one recipe on FSDP, routing replay off / rollout; per-step metrics."""
    m = Model("MoE", "qwen3_moe", args.mm_layers, "a3b-half")
    model = make_model(args, m)
    loss = {"old_logprobs": "recompute", "kl_coef": 0.0}
    recipe = mismatch_recipe(args, model, "moe-mismatch", "fsdp", args.steps, loss)
    keys = {k: f"train/{k}" for k in ("logprob_mismatch", "router_agreement", "router_natural_agreement")}
    info = dict(params=param_counts(model), layers=args.mm_layers, shape=m.shape(args.smoke))
    return [
        dict(routing_replay=replay, **info)
        | mismatch_run(
            recipe,
            args.workdir,
            f"moe-mismatch-{replay}",
            [f"train.routing_replay={replay}"],
            args.steps,
            keys,
        )  # fmt: skip
        for replay in ("off", "rollout")
    ]


# ---- the tables ------------------------------------------------------------------------------------


def millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe(shape: dict) -> str:
    """One model's shapes in words."""
    heads = f"{shape['num_attention_heads']} / {shape['num_key_value_heads']} heads of {shape['head_dim']}"
    mlp = (f"{shape['num_experts']} experts top-{shape['num_experts_per_tok']}, expert intermediate "
           f"{shape['moe_intermediate_size']}" if "num_experts" in shape
           else f"intermediate {shape['intermediate_size']}")  # fmt: skip
    return f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, {heads}, {mlp}"


def header(args, device: str, start: str, end: str) -> list[str]:
    w = workloads(args.smoke)
    return [
        f"### Mixture of experts on one GPU: decode vs dense, mismatch with and without R3 ({start} - {end} UTC)",
        "",
        f"    python -m bench.moe_gpu {' '.join(sys.argv[1:])}".rstrip(),
        "",
        f"{versions(device)}; {code_version()}.",
        "",
        "- params: from the checkpoint's tensors, embeddings and untied LM head included; active = what one "
        "token uses (top-k of the experts of each MoE layer, every other tensor whole).",
        f"- decode tok/s = generated tokens / wall seconds from submitting the batch to its last token (prefill "
        f"included, graphs captured before); {w[0].name}: {w[0].requests} requests, {w[1].name}: "
        f"{w[1].requests} requests, each prompt {w[0].prompt} random tokens, {w[0].completion} new tokens, "
        f"temperature 1, ignore_eos. Range = min-max over {args.rounds} rounds.",
        "- MoE / dense = MoE tok/s / dense tok/s, same round and workload (1 would mean the MoE decodes as fast "
        "as a dense model of its active size).",
        "- mismatch = train/logprob_mismatch: mean over the step's response tokens of |logp_train - "
        "logp_rollout| (the trainer's recomputed log-prob before the step's update vs the engine's sampling "
        f"log-prob); mean = over the {args.steps} steps. router agreement = train/router_agreement: share of "
        "(token, MoE layer) pairs whose experts in training equal the rollout's; natural = "
        "train/router_natural_agreement, the trainer router's own top-k against the rollout's. Both are "
        "reported only under R3 (without it the rollout does not return its experts).",
        "",
    ]


def decode_table(rows: list[dict]) -> list[str]:
    out = [
        "| model | shapes | params total | params active | workload | tok/s (min-max) | MoE / dense (min-max) |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        moe = r["arch"] == "qwen3_moe"
        ratio = span(r["vs_dense"], "{:.2f}x".format) if moe else "reference"
        out.append(
            f"| {r['model']} ({r['arch']}) | {describe(r['shape'])} | {millions(r['params']['total'])} | "
            f"{millions(r['params']['active'])} | {r['workload']} | {span(r['tok_s'], tok)} | {ratio} |"
        )
    return out


def mismatch_table(rows: list[dict], args) -> list[str]:
    p = rows[0]["params"]
    out = [
        f"{args.steps} synchronous GRPO steps, train.backend=fsdp, seed {args.seed}, Qwen3-MoE of "
        f"{describe(rows[0]['shape'])} ({millions(p['total'])} params, {millions(p['active'])} active), "
        f"{args.mm_prompts} prompts x {args.mm_samples} samples, prompt {args.mm_prompt}, "
        f"{args.mm_completion} new tokens:",
        "",
        "| train.routing_replay | mismatch mean | per step (min-max) | router agreement mean | natural mean (min-max) |",
        "|---|---:|---:|---:|---:|",
    ]
    means = {}
    for r in rows:
        vals = r["logprob_mismatch"]
        if "failed" in r or not vals:
            out.append(f"| {r['routing_replay']} | failed: {r.get('failed', 'no steps')} | | | |")
            continue
        means[r["routing_replay"]] = statistics.mean(vals)
        agree, nat = r["router_agreement"], r["router_natural_agreement"]
        a = f"{statistics.mean(agree):.4f}" if agree else "-"
        n = f"{statistics.mean(nat):.4f} ({span(nat, '{:.4f}'.format)})" if nat else "-"
        out.append(
            f"| {r['routing_replay']} | {SCI(means[r['routing_replay']])} | {span(vals, SCI)} | {a} | {n} |"
        )
    out += [
        "",
        "| step | " + " | ".join(r["routing_replay"] for r in rows) + " |",
        "|---:" * (len(rows) + 1) + "|",
    ]
    for s in range(max(len(r["logprob_mismatch"]) for r in rows)):
        vals = [SCI(r["logprob_mismatch"][s]) if s < len(r["logprob_mismatch"]) else "-" for r in rows]
        out.append(f"| {s + 1} | " + " | ".join(vals) + " |")
    if len(means) == 2:
        off, r3 = means["off"], means["rollout"]
        pairs = list(zip(rows[0]["logprob_mismatch"], rows[1]["logprob_mismatch"], strict=False))
        below = sum(b < a for a, b in pairs)
        lower = "lower" if r3 < off else "NOT lower"
        ratio = f", {r3 / off:.2f}x" if off else ""
        out += ["", f"With routing replay the mismatch is {lower} than without: mean {SCI(r3)} vs {SCI(off)}"
                f"{ratio}; lower in {below} of {len(pairs)} steps."]  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--part", action="append", choices=PARTS, help="run only this part (repeatable; default both)"
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of the decode part (>= 1)")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of each mismatch run")
    p.add_argument("--layers", type=int, default=12, help="decoder layers of the decode part's models")
    p.add_argument("--mm-layers", type=int, default=4, help="decoder layers of the mismatch part's MoE")
    p.add_argument("--mm-prompts", type=int, default=16)
    p.add_argument("--mm-samples", type=int, default=8)
    p.add_argument("--mm-prompt", type=int, default=128)
    p.add_argument("--mm-completion", type=int, default=128)
    p.add_argument("--micro-tokens", type=int, default=8192, help="train.max_tokens_per_microbatch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--grouped", action="store_true", help="decode also the MoE through torch._grouped_mm (the anchor)"
    )
    p.add_argument("--workdir", default="runs/bench_moe", help="models, recipes and run directories")
    p.add_argument("--out", default=None, help="JSON file for the raw numbers")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny MoE, small sizes: checks the plumbing")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.layers, args.mm_layers = 2, 2, 2, 2
        args.mm_prompts, args.mm_samples, args.mm_prompt, args.mm_completion, args.micro_tokens = (
            2,
            2,
            8,
            4,
            512,
        )
    if min(args.rounds, args.steps, args.layers, args.mm_layers) < 1:
        p.error("--rounds, --steps, --layers and --mm-layers must be >= 1")
    args.workdir = str(Path(args.workdir).resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, start = bench_device(args, "bench.moe_gpu"), utc_now()
    runners = {"mismatch": lambda: mismatch_part(args, device), "decode": lambda: decode_part(args, device)}
    results, errors = run_parts(args, PARTS, runners)
    engine = "CPU, float32 (smoke)" if args.smoke else "CUDA graphs, bf16"
    sections = [
        ("decode", f"Decode: embedded engine in process, {engine}", decode_table),
        ("mismatch", "Train-rollout log-prob mismatch, routing replay off vs rollout (R3)",
         lambda r: mismatch_table(r, args)),
    ]  # fmt: skip
    return report(args, header(args, device, start, utc_now()), sections, results, errors)


if __name__ == "__main__":
    sys.exit(main())
