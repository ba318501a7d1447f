"""DeepSeek-V4 on one GPU: decode tok/s of a V4-Flash-shaped model at reduced depth against a Qwen3-MoE of
the same active size, and the engine-trainer |delta log p| over GRPO steps with R3 off and on.

    python -m bench.deepseek_v4_gpu [--part decode|mismatch ...] [--layers 4] [--rounds 3] [--steps 20] [--out F.json]
    python -m bench.deepseek_v4_gpu --smoke      # CPU, tiny shapes: the plumbing, not figures

1. decode: the embedded engine in this process (CUDA graphs, bf16, temperature 1, ignore_eos) on
   random weights made on the GPU (no checkpoint is written: at full width one is ~54 GB). DeepSeek-V4
   Flash's layer at full width (hidden 4096, 64 heads of 512 on one shared KV head, q rank 1024, output
   groups 8 x 1024, 256 experts top-6 of intermediate 2048 plus a shared one, indexer 64 heads of 128
   keeping 512 entries, window 128, CSA 4:1, HCA 128:1, 4 hyper-connection streams, 129,280-token
   vocabulary) cut to `--layers` layers covering every kind (sliding, CSA, HCA, then CSA; the first
   hash-routed); against a Qwen3-MoE of the same hidden size and experts (32 / 4 heads of 128, 256
   experts of 2048, top-k chosen so its active parameters per token come closest to V4's). The two do
   not fit one 80 GB card together: each is built, warmed (graph captures) and timed in turn.
   Workloads: decode-heavy (256 requests) and small batch (32), prompt 128 random tokens, 256 new.
2. mismatch: `miles train` on the FSDP backend (or `--backend megatron`, both with two `--backend`s),
   bench/parts.py's synchronous GRPO recipe (bf16), R3 off and on, the train step's seconds and MFU,
   on a V4 of reduced width (hidden 1024, 16 heads of 128, 64 experts top-6 of 384, the same layer
   kinds): a full-width V4 layer holds 6.4B parameters, beyond one card's training memory. From each run: train/logprob_mismatch per step and the router agreements. (Its vocabulary is Qwen2.5's
   151,936 ids, the recipe's random prompts being drawn from them.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.fp8_gpu import SCI, Workload, code_version, engine_run, span, tok, versions
from bench.parts import bench_device, free_memory, mismatch_recipe, mismatch_run, report, run_parts, utc_now

VOCAB = 129_280
KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
V4_FLASH = dict(hidden_size=4096, num_attention_heads=64, head_dim=512, partial_rotary_factor=0.125, q_lora_rank=1024,
                o_groups=8, o_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
                intermediate_size=2048, index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
                hc_mult=4, compress_rates={KINDS[1]: 4, KINDS[2]: 128}, routed_scaling_factor=1.5)  # fmt: skip
V4_NARROW = V4_FLASH | dict(hidden_size=1024, num_attention_heads=16, head_dim=128, q_lora_rank=384, o_groups=4,
                            o_lora_rank=256, n_routed_experts=64, moe_intermediate_size=384, intermediate_size=384,
                            index_n_heads=16, index_head_dim=64, index_topk=64,
                            compress_rates={KINDS[1]: 4, KINDS[2]: 32})  # fmt: skip
V4_TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=32, n_routed_experts=8, index_topk=4,
               sliding_window=8, compress_rates={KINDS[1]: 4, KINDS[2]: 8})  # fmt: skip
QWEN = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=256,
            moe_intermediate_size=2048, mlp_only_layers=[], norm_topk_prob=True)  # fmt: skip
QWEN_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 moe_intermediate_size=32, mlp_only_layers=[], norm_topk_prob=True)  # fmt: skip
PARTS = ("mismatch", "decode")


def v4_layers(n: int) -> dict:
    """`n` layers covering every attention kind (sliding, CSA, HCA, CSA, ...), the first hash-routed."""
    kinds = [KINDS[0], KINDS[1], KINDS[2]] + [KINDS[1 + i % 2] for i in range(max(n - 3, 0))]
    return dict(num_hidden_layers=n, layer_types=kinds[:n], mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1))


@dataclass(frozen=True)
class Model:
    """One arm: what bench/fp8_gpu.py's engine_run reads of it (a bf16 engine)."""

    label: str
    arch: str
    shape: tuple
    quantization: str = "none"
    min_tokens: None = None

    @property
    def sizes(self) -> dict:
        return dict(self.shape)


def _config(m: Model):
    from miles.models.families import family_of_model_type
    from miles.models.tiny import build_tokenizer, model_config

    tok = build_tokenizer(384, 0)
    cfg = model_config(m.arch, VOCAB, tok.eos_token_id, tok.pad_token_id, **m.sizes)
    cfg.tie_word_embeddings, cfg.max_position_embeddings = False, 4096
    cfg.architectures = [family_of_model_type(m.arch).hf_arch]
    return cfg


def params(cfg) -> dict[str, int]:
    """Total parameters and those one token uses (k of E routed experts per layer), from the shapes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = routed = 0
    for name, t in model.named_parameters():
        total += t.numel()
        routed += t.numel() if ".experts." in name and "shared" not in name else 0
    experts = getattr(cfg, "n_routed_experts", None) or cfg.num_experts
    return dict(total=total, active=total - routed + routed * cfg.num_experts_per_tok // experts)


def build(m: Model, device: str, dtype: torch.dtype, seed: int):
    """The engine's decoder of `m` with random weights made on `device` (the config alone on disk)."""
    from transformers import AutoModelForCausalLM

    from miles.engine.fp8_weights import plain_decoder
    from miles.engine.model import ModelSpec

    cfg = _config(m)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        spec = ModelSpec.from_dir(tmp)
    with torch.device("meta"):
        shapes = {
            n: (t.shape, t.dtype) for n, t in AutoModelForCausalLM.from_config(cfg).state_dict().items()
        }
    zeros = {n: torch.zeros((), dtype=dt, device=device).expand(s) for n, (s, dt) in shapes.items()}
    decoder = plain_decoder(spec, zeros, device, dtype)
    del zeros
    g = torch.Generator(device).manual_seed(seed)
    for name, t in decoder.storage.items():
        if t.dtype == torch.int64:  # the hash layers' token -> experts table: k distinct experts a row
            scores = torch.rand(t.shape[0], spec.moe.num_experts, device=device, generator=g)
            t.copy_(scores.argsort(dim=-1)[:, : t.shape[1]])
        elif name.endswith(("norm.weight", ".scale", "hc_scale")):
            t.fill_(1.0)
        elif name.endswith(("base", "sinks", "position_bias", "e_score_correction_bias")):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=g)
    return decoder, cfg


def decode_models(args) -> list[Model]:
    v4 = (V4_TINY if args.smoke else V4_FLASH) | v4_layers(args.layers)
    v4m = Model("DeepSeek-V4", "deepseek_v4", tuple(v4.items()))
    qwen = (QWEN_TINY if args.smoke else QWEN) | {"num_hidden_layers": args.layers}
    target = params(_config(v4m))["active"]
    best = min(range(1, 17), key=lambda k: abs(params(_config(_qwen(qwen, k)))["active"] - target))
    return [v4m, _qwen(qwen, best)]


def _qwen(shape: dict, k: int) -> Model:
    return Model(f"Qwen3-MoE top-{k}", "qwen3_moe", tuple((shape | {"num_experts_per_tok": k}).items()))


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        return [Workload("decode-heavy", 4, 8, 4, False), Workload("small batch", 2, 8, 4, False)]
    return [Workload("decode-heavy", 256, 128, 256, False), Workload("small batch", 32, 128, 256, False)]


def _prompts(rng: random.Random, w: Workload) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(w.prompt)] for _ in range(w.requests)]


def decode_part(args, device: str) -> list[dict]:
    """tok/s of each model on each workload over `args.rounds` rounds, one model resident at a time."""
    from miles.engine.scheduler import Scheduler

    dtype = torch.float32 if args.smoke else torch.bfloat16
    loads, rows = workloads(args.smoke), []
    width = max(w.requests for w in loads)
    slots = max(w.requests * (w.prompt + w.completion) for w in loads) + 4096
    for m in decode_models(args):
        decoder, cfg = build(m, device, dtype, args.seed)
        sched = Scheduler(decoder, width, slots)
        rng = random.Random(args.seed)
        for w in loads:
            engine_run(sched, m, _prompts(rng, w), w, device)  # untimed: graph captures, allocator growth
            vals = []
            for r in range(args.rounds):
                vals.append(engine_run(sched, m, _prompts(rng, w), w, device))
                print(f"decode {w.name} round {r + 1} {m.label}: {vals[-1]:.0f} tok/s", flush=True)
            rows.append(dict(model=m.label, arch=m.arch, shape=m.sizes, params=params(cfg), workload=w.name,
                             workload_shape=vars(w), tok_s=vals))  # fmt: skip
        del decoder, sched
        free_memory()
    return rows


def mismatch_part(args, device: str) -> list[dict]:
    """`miles train` runs per trainer (--backend, FSDP by default), routing replay off / rollout;
    per-step metrics and train-step seconds."""
    from miles.models.tiny import QWEN25_VOCAB, init_random

    shape = (V4_TINY if args.smoke else V4_NARROW) | v4_layers(args.layers)
    out = Path(args.workdir) / f"model-v4-{'tiny' if args.smoke else 'narrow'}-L{args.layers}"
    if not (out / "config.json").exists():
        init_random(out, shape=shape, vocab_size=QWEN25_VOCAB, tie_word_embeddings=False,
                    dtype="float32" if args.smoke else "bfloat16", seed=args.seed, arch="deepseek_v4")  # fmt: skip
        free_memory()
    keys = {k: f"train/{k}" for k in ("logprob_mismatch", "router_agreement", "router_natural_agreement")}
    keys["train_s"] = "time/train_s"
    info = dict(params=params(_config(Model("v4", "deepseek_v4", tuple(shape.items())))), shape=shape,
                tokens_per_step=args.mm_prompts * args.mm_samples * (args.mm_prompt + args.mm_completion))  # fmt: skip
    rows = []
    for backend in args.backend or ["fsdp"]:
        name = f"v4-mismatch-{backend}"
        recipe = mismatch_recipe(args, out, name, backend, args.steps, {"old_logprobs": "recompute"})
        for r in args.replay:
            sets = [f"train.routing_replay={r}"]
            rows.append(dict(backend=backend, routing_replay=r, **info)
                        | mismatch_run(recipe, args.workdir, f"{name}-{r}", sets, args.steps, keys))  # fmt: skip
    return rows


def _b(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def decode_table(rows: list[dict]) -> list[str]:
    out = ["| model | layers | params total | params active | workload | tok/s (min-max) | V4 / Qwen3-MoE |",
           "|---|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    ref = {r["workload"]: r["tok_s"] for r in rows if r["arch"] == "qwen3_moe"}
    for r in rows:
        mine = r["arch"] == "deepseek_v4" and r["workload"] in ref
        ratio = (
            span([a / b for a, b in zip(r["tok_s"], ref[r["workload"]], strict=True)], "{:.2f}x".format)
            if mine
            else "reference"
        )
        out.append(f"| {r['model']} | {r['shape']['num_hidden_layers']} | {_b(r['params']['total'])} | "
                   f"{_b(r['params']['active'])} | {r['workload']} | {span(r['tok_s'], tok)} | {ratio} |")  # fmt: skip
    return out


PEAK_BF16 = 989.4e12
"""Dense bf16 peak of an H100 / H200 SXM (FLOP/s), MFU's denominator."""


def mismatch_table(rows: list[dict]) -> list[str]:
    out = ["| trainer | train.routing_replay | mismatch mean | per step (min-max) | router agreement | natural (min-max) "
           "| train step s (median, min-max; step 1 left out) | MFU |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        vals = r.get("logprob_mismatch") or []
        who = f"| {r.get('backend', 'fsdp')} | {r['routing_replay']} |"
        if "failed" in r or not vals:
            out.append(f"{who} failed: {r.get('failed', 'no steps')} | | | | | |")
            continue
        agree, nat = r.get("router_agreement") or [], r.get("router_natural_agreement") or []
        a = f"{statistics.mean(agree):.4f}" if agree else "-"
        n = f"{statistics.mean(nat):.4f} ({span(nat, '{:.4f}'.format)})" if nat else "-"
        times = (r.get("train_s") or [])[1:]
        t = statistics.median(times) if times else None
        step = f"{t:.3f} ({span(times, '{:.3f}'.format)})" if t else "-"
        mfu = f"{6 * r['params']['active'] * r['tokens_per_step'] / t / PEAK_BF16:.3f}" if t else "-"
        out.append(f"{who} {SCI(statistics.mean(vals))} | {span(vals, SCI)} | {a} | {n} | {step} | {mfu} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", action="append", choices=PARTS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="runs/bench-deepseek-v4")
    p.add_argument("--out")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--mm-prompts", type=int, default=16)
    p.add_argument("--mm-samples", type=int, default=8)
    p.add_argument("--mm-prompt", type=int, default=128)
    p.add_argument("--mm-completion", type=int, default=128)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--backend", action="append", choices=["fsdp", "megatron"], help="mismatch: trainer(s)")
    p.add_argument("--replay", nargs="+", choices=["off", "rollout"], default=["off", "rollout"],
                   help="mismatch: the train.routing_replay arms to run")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.mm_prompts, args.mm_samples = 2, 2, 2, 2
        args.mm_prompt, args.mm_completion = 8, 4
    device = bench_device(args, "bench.deepseek_v4_gpu")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    start = utc_now()
    runners = {"decode": lambda: decode_part(args, device), "mismatch": lambda: mismatch_part(args, device)}
    results, errors = run_parts(args, PARTS, runners)
    lines = [
        f"### DeepSeek-V4 on one GPU: decode vs Qwen3-MoE, mismatch with and without R3 ({start} - {utc_now()} UTC)",
        "",
        f"    python -m bench.deepseek_v4_gpu {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        "",
        f"{versions(device)}; {code_version()}.",
        "",
        "- params from the shapes (embeddings and untied head included); active = every tensor but the routed "
        "experts, plus k of E of them per layer (V4: top-6 and the shared expert).",
        "- decode tok/s = generated tokens / wall seconds from submitting the batch to its last token (prefill "
        "included, graphs captured before); range = min-max over the rounds; V4 / Qwen3-MoE = same round.",
        "- mismatch = train/logprob_mismatch: mean |logp_train - logp_rollout| over the step's response tokens.",
        "- train step = time/train_s (the trainer's step: old log-probs recomputed, then the update); MFU = 6 x "
        "active params x tokens per step / step seconds / 989.4 TFLOP/s (dense bf16 peak of an H100/H200 SXM; "
        "attention FLOPs and the recompute forward left out).",
        "",
    ]
    sections = [("decode", "Decode", decode_table), ("mismatch", "Mismatch, R3 off and on", mismatch_table)]
    return report(args, lines, sections, results, errors)


if __name__ == "__main__":
    sys.exit(main())
