"""LoRA in the embedded engine on one GPU: decode tok/s with 0, 1, 4 and 8 adapters, adapter push vs full push.

    python -m bench.lora_gpu [--part decode|push ...] [--rounds 2] [--out F.json]
    python -m bench.lora_gpu --smoke      # CPU, tiny model: the plumbing, not figures

1. decode: the engine in this process (bench/fp8_gpu.py's in-process Scheduler, CUDA graphs, bf16,
   temperature 1, ignore_eos) on Qwen2.5-0.5B shapes, 256 requests, prompt 128, 128 new tokens. Arms:
   `base` (no LoRA bank); banks of 1, 4 or 8 slots (--max-loras-per-batch), rank 16, every attention
   and MLP projection, with every request on the base model, on one adapter, or spread round-robin
   over 4 or 8 adapters; and anchors for the bank of 1: its A in tensors of its own (an A GEMM, then
   the Triton kernel: the path before A was stacked under the weights); the kernels that read a
   layer's output (gate/up's activation "silu"; q/k/v's RoPE and K/V store "rope") all apart from the
   adapters' kernel ("next kernels apart"), or one of them apart or fused beside the default
   (miles/engine/lora_terms.py FUSED); and without the Triton kernels (miles/engine/triton_lora.py), as
   the CPU computes it (A GEMM, mask, B GEMM-accumulate). Adapters are random (A, B ~ N(0, 0.02)). One
   untimed run per arm, then `--rounds` rounds, arms rotated; vs base = tok/s / base tok/s of the same
   round. `--profile [ARM ...]`: the CUDA kernels of one eager decode step of those arms.
2. push: Qwen2.5-0.5B and -7B shapes: bytes of a rank-16 adapter on every projection against the whole
   model in bf16, and the time to move each into an engine in process: the full weights by
   `Decoder.load` from GPU tensors; the adapter as the wire carries it (tensors pickled inline from the
   host, `serialize_inline`), decoded and loaded into its slot (`LoraBank.load`). Median of `--rounds`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.fp8_gpu import make_model, rotated, sync
from bench.parts import bench_device, free_memory, report, run_parts, utc_now

PARTS = ("push", "decode")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 16


def _bank(decoder, slots: int, max_rows: int, **stack):
    from miles.engine.lora import LoraBank

    return LoraBank.for_decoder(decoder, slots, RANK, TARGETS, max_rows, **stack)


def _adapter(bank, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m, (o, i) in bank.modules.items():
        out[f"base_model.model.{m}.lora_A.weight"] = (torch.randn(RANK, i, generator=g) * 0.02).to(bank.dtype)
        out[f"base_model.model.{m}.lora_B.weight"] = (torch.randn(o, RANK, generator=g) * 0.02).to(bank.dtype)
    return out


def decode_part(args, device: str) -> list[dict]:
    from miles.engine.fp8_weights import build_decoder
    from miles.engine.lora import AdapterConfig
    from miles.engine.lora_terms import CONSUMERS, FUSED
    from miles.engine.model import ModelSpec
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    dtype = torch.float32 if args.smoke else torch.bfloat16
    path = make_model(Path(args.workdir), "tiny" if args.smoke else "0.5b", str(dtype).removeprefix("torch."))
    batch, prompt, new = (4, 8, 4) if args.smoke else (256, 128, 128)
    spec = ModelSpec.from_dir(path)
    config = AdapterConfig(RANK, 2.0 * RANK, TARGETS)

    def bank(slots: int, loaded: int, fuse: frozenset[str] | None = None, kernels: bool = True, **stack):
        """A decoder with a bank of `slots` slots, `loaded` of them holding an adapter; `fuse`: the
        consumer kernels that add the term (LoraTerms.fuse_consumers; None: the default)."""
        d = build_decoder(spec, path, device, dtype, "none", 1024)
        d.lora = _bank(d, slots, batch, **stack)
        for k in range(loaded):
            d.lora.load(f"a{k}", config, _adapter(d.lora, k), "random")
        if fuse is not None:
            d.lora.terms.fuse_consumers = fuse
        if not kernels:  # the PyTorch path (A GEMM, mask, B GEMM-accumulate)
            d.lora.terms.blocks = {}
        return d

    banks = {size: bank(size, size) for size in (1, 4, 8)}
    slots = batch * (prompt + new) + 4096
    one = "1 adapter, bank of 1"
    arms = {"base": (build_decoder(spec, path, device, dtype, "none", 1024), 0),
            "bank of 8, no adapter": (banks[8], 0), one: (banks[1], 1),
            f"{one}, A GEMM apart": (bank(1, 1, stack=None), 1),  # A in tensors of its own
            f"{one}, next kernels apart": (bank(1, 1, fuse=frozenset()), 1),  # split, then the next kernel
            f"{one}, PyTorch path": (bank(1, 1, kernels=False), 1)}  # fmt: skip
    for c in sorted(CONSUMERS):  # one consumer kernel apart from, or fused with, the default
        arms[f"{one}, {c} {'apart' if c in FUSED else 'fused too'}"] = (bank(1, 1, fuse=FUSED ^ {c}), 1)
    arms |= {"1 adapter, bank of 8": (banks[8], 1), "4 adapters, bank of 4": (banks[4], 4),
             "8 adapters, bank of 8": (banks[8], 8)}  # fmt: skip
    for align in args.align or []:  # the stacked block padded to other multiples (the A rows alone: 1)
        arms[f"{one}, stacked rows a multiple of {align}"] = (bank(1, 1, stack=align), 1)
    scheds = {a: Scheduler(d, batch, slots) for a, (d, _) in arms.items()}
    rng = random.Random(args.seed)

    def run(arm: str, prompts: list[list[int]]) -> float:
        sched, n = scheds[arm], arms[arm][1]
        sched.holdings.flush_cache()
        sp = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
        reqs = [
            Request(str(i), p, sp, i, frozenset(), lora=f"a{i % n}" if n else None)
            for i, p in enumerate(prompts)
        ]
        sync(device)
        start = time.perf_counter()
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        sync(device)
        if any(len(r.output) != new for r in reqs):
            raise RuntimeError(f"{arm}: a request did not generate {new} tokens")
        return batch * new / (time.perf_counter() - start)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(spec.vocab_size) for _ in range(prompt)] for _ in range(batch)]

    names = list(arms)
    for a in names:
        run(a, prompts())
    tok_s = {a: [] for a in names}
    for r in range(args.rounds):
        ps = prompts()
        for a in rotated(names, r):
            tok_s[a].append(run(a, ps))
            print(f"decode round {r + 1} {a}: {tok_s[a][-1]:.0f} tok/s", flush=True)
    if args.profile and device == "cuda":  # the kernels of one eager decode step of some arms
        from bench.engine_gpu import profile_decode

        shape = argparse.Namespace(requests=batch, prompt=prompt, completion=new)
        for a in args.profile:
            d, n = arms[a]
            lora = (
                torch.tensor([d.lora.slots[f"a{i % n}"] for i in range(batch)], device=device) if n else None
            )
            print(f"#### kernels of one decode step: {a}")
            profile_decode(scheds[a], shape, lora)
    scheds.clear()
    free_memory()
    return [
        dict(arm=a, tok_s=v, vs_base=[x / b for x, b in zip(v, tok_s["base"], strict=True)])
        for a, v in tok_s.items()
    ]


def push_part(args, device: str) -> list[dict]:
    from miles.engine.fp8_weights import build_decoder
    from miles.engine.lora import AdapterConfig
    from miles.engine.model import ModelSpec, load_weights
    from miles.weights.tensor import deserialize, serialize_inline

    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows = []
    for size in ["tiny"] if args.smoke else ["0.5b", "7b"]:
        path = make_model(Path(args.workdir), size, str(dtype).removeprefix("torch."))
        spec = ModelSpec.from_dir(path)
        dec = build_decoder(spec, path, device, dtype, "none", 1024)
        dec.lora = _bank(dec, 2, 8)
        weights = {n: t.to(device) for n, t in load_weights(path).items()}
        adapter = _adapter(dec.lora, 0)
        config = AdapterConfig(RANK, 2.0 * RANK, TARGETS)
        full_s, adapter_s = [], []
        for _ in range(max(args.rounds, 3)):
            sync(device)
            t0 = time.perf_counter()
            dec.load(weights)
            sync(device)
            full_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            named = dict(deserialize(serialize_inline(list(adapter.items()))))
            dec.lora.load("policy", config, named, "__tensor__")
            sync(device)
            adapter_s.append(time.perf_counter() - t0)
        rows.append(dict(size=size, full_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
                         adapter_bytes=sum(t.numel() * t.element_size() for t in adapter.values()),
                         full_s=full_s, adapter_s=adapter_s))  # fmt: skip
        print(
            f"push {size}: full {statistics.median(full_s):.4f} s, adapter {statistics.median(adapter_s):.4f} s",
            flush=True,
        )
        del dec, weights
        free_memory()
    return rows


def _range(vals: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"


def decode_table(rows: list[dict]) -> list[str]:
    out = ["| arm | tok/s (min-max) | vs base (min-max) |", "|---|---:|---:|"]
    out += [f"| {r['arm']} | {_range(r['tok_s'], '{:.0f}')} | {_range(r['vs_base'])} |" for r in rows]
    return out


def push_table(rows: list[dict]) -> list[str]:
    out = ["| shapes | full MiB | adapter MiB | bytes ratio | full load s | adapter wire + load s |",
           "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['size']} | {r['full_bytes'] / 2**20:.0f} | {r['adapter_bytes'] / 2**20:.1f} | "
            f"{r['full_bytes'] / r['adapter_bytes']:.0f} | {_range(r['full_s'], '{:.4f}')} | {_range(r['adapter_s'], '{:.4f}')} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", action="append", choices=PARTS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="runs/bench_lora")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument(
        "--profile",
        nargs="*",
        default=None,
        help="decode: print the kernels of one eager step of these arms (none named: base, a bank of 8 "
        "with no adapter, one adapter)",
    )
    p.add_argument(
        "--align",
        type=int,
        action="append",
        help="decode: also the bank of 1 with its stacked block a multiple of N rows",
    )
    args = p.parse_args(argv)
    if args.profile == []:
        args.profile = ["base", "bank of 8, no adapter", "1 adapter, bank of 1"]
    args.workdir = str(Path(args.workdir).resolve())
    device, start = bench_device(args, "bench.lora_gpu"), utc_now()
    results, errors = run_parts(
        args, PARTS, {"push": lambda: push_part(args, device), "decode": lambda: decode_part(args, device)}
    )
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    head = [f"bench.lora_gpu, {start} - {utc_now()} UTC, torch {torch.__version__}, {gpu}", "",
            "    python -m bench.lora_gpu " + " ".join(sys.argv[1:]), ""]  # fmt: skip
    sections = [("push", "Adapter push vs full push, in process", push_table),
                ("decode", "Decode with LoRA adapters, batch 256", decode_table)]  # fmt: skip
    return report(args, head, sections, results, errors)


if __name__ == "__main__":
    sys.exit(main())
