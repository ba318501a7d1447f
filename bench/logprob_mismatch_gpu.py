"""Where the bf16 train/rollout log-prob mismatch comes from, on GPU.

    python3 -m bench.logprob_mismatch_gpu --requests 64 --out $OUT/mismatch.json

The engine (in-process scheduler, bf16, CUDA graphs, temperature 1) samples `--completion` tokens
after random prompts of `--prompt` tokens on the random-init Qwen2.5-0.5B-shaped model of
bench/e2e_gpu.py; the same tokens are then scored by transformers in bf16 (what a bf16 trainer
computes) and in fp32 (the reference). Printed: mean and max |a - b| over all response tokens for
engine vs HF bf16 (the train/rollout mismatch a trainer sees), engine vs fp32 and HF bf16 vs fp32
(how far each bf16 side is from exact), for the decode attention read in place (Triton) and the
gather + SDPA path.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch


def sample(model: Path, prompts: list[list[int]], completion: int, paged: bool) -> list[tuple[list, list]]:
    from miles.engine.model import Decoder, ModelSpec, load_weights
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    decoder = Decoder(ModelSpec.from_dir(model), load_weights(model), "cuda", torch.bfloat16)
    decoder.paged_decode = paged
    sched = Scheduler(decoder, len(prompts), len(prompts) * (len(prompts[0]) + completion + 8))
    reqs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=completion, temperature=1.0, ignore_eos=True)
        reqs.append(Request(rid=str(i), prompt=p, params=sp, seed=i, stop_ids=frozenset()))
        sched.submit(reqs[-1])
    sched.run_until_idle()
    out = [r.done.result(timeout=0) for r in reqs]
    return [(r.output, r.logprobs) for r in out]


@torch.no_grad()
def hf_logprobs(model: Path, prompts, outputs, dtype: torch.dtype, chunk: int = 4) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    res = []
    for i in range(0, len(prompts), chunk):
        ids = torch.tensor(
            [p + o for p, o in zip(prompts[i : i + chunk], outputs[i : i + chunk], strict=True)],
            device="cuda",
        )
        logits = hf(ids).logits.float()
        n = len(prompts[i])
        logp = logits[:, n - 1 : -1].log_softmax(-1)
        res += list(logp.gather(-1, ids[:, n:, None])[..., 0].cpu())
    del hf
    torch.cuda.empty_cache()
    return res


def stats(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    d = (torch.cat(a) - torch.cat(b)).abs()
    return {"mean": d.mean().item(), "max": d.max().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--model", default="runs/bench_e2e/model-qwen25-05b")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from miles.models.tiny import init_random

    model = Path(args.model)
    if not (model / "config.json").exists():
        init_random(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 151_000) for _ in range(args.prompt)] for _ in range(args.requests)]
    results = {}
    for paged in (True, False):
        got = sample(model, prompts, args.completion, paged)
        outputs = [o for o, _ in got]
        engine = [torch.tensor(lp) for _, lp in got]
        bf16 = hf_logprobs(model, prompts, outputs, torch.bfloat16)
        fp32 = hf_logprobs(model, prompts, outputs, torch.float32)
        name = "triton_paged" if paged else "gather_sdpa"
        results[name] = {
            "engine_vs_hf_bf16": stats(engine, bf16),
            "engine_vs_fp32": stats(engine, fp32),
            "hf_bf16_vs_fp32": stats(bf16, fp32),
            "tokens": sum(len(o) for o in outputs),
        }
    print(f"{'decode attention':16s} {'pair':20s} {'mean':>8s} {'max':>8s}")
    for name, r in results.items():
        for pair in ("engine_vs_hf_bf16", "engine_vs_fp32", "hf_bf16_vs_fp32"):
            print(f"{name:16s} {pair:20s} {r[pair]['mean']:8.5f} {r[pair]['max']:8.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
