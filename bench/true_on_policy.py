"""What true on-policy (`train.true_on_policy`) costs, and what it changes in learning.

    python -m bench.true_on_policy --part cost [--model 0.5b|tiny] [--rounds 3] [--kernels torch|triton] [--out F.json]
    python -m bench.true_on_policy --part learning [--seeds 0 1 2] [--steps 30] [--out F.json]   # CPU

1. cost (GPU: bf16; CPU: fp32): the embedded engine's decode throughput with and without
   `--enable-deterministic-inference` (a real engine process each; on CUDA both with and without
   `--disable-cuda-graph`, graphs being the engine's default), `--requests` concurrent requests of `--prompt` random ids and exactly
   `--new` new tokens (ignore_eos), tok/s = generated tokens / wall seconds of the whole batch; and the
   trainer's step: forward + backward of one packed row per `--train-rows` shape (`SEQSxLEN`: SEQS
   sequences of LEN tokens; the default's 32x256 and 8x1024 fill the FSDP trainer's default
   micro-batch, train.max_tokens_per_microbatch = 8192, and 8x256 shows a small one, where launching
   kernels from the host bounds both arms). Mode: transformers' model with
   miles/train/fsdp/true_on_policy.py installed, scored by its `logprobs`; anchor: the same model as the
   trainer runs it with the mode off (sdpa attention, the fused log-prob kernel of
   miles/train/losses/fused_logprob.py). The two take turns for `--rounds` rounds; median and fastest.
   Ratios: mode / anchor of the same run and shape.
2. learning (CPU, the tiny model): `miles train recipes/default.yaml` (the digits task) on a
   synchronous schedule, TIS off, `--steps` steps, per seed with the mode on and off: eval/reward_mean
   on the held-out prompts at every evaluation (step 0 included), and the per-step
   train/logprob_mismatch (mean |log p_rollout - log p_trainer| over response tokens, the first-order
   size of the rollout-trainer KL, which the trainer reports every step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

FLAGS = ["--enable-deterministic-inference", "--rl-on-policy-target", "fsdp"]
REPO = Path(__file__).resolve().parent.parent


def _model(kind: str, work: Path) -> str:
    from miles.models.tiny import init_random, init_tiny

    out = work / f"model-{kind}"
    if (out / "config.json").exists():
        return str(out)
    if kind == "tiny":
        return str(init_tiny(out, seed=0))
    return str(init_random(out, dtype="bfloat16", seed=0))


def decode_tok_s(model: str, device: str, flags: list[str], args, log: Path) -> float:
    """Generated tokens / wall seconds of `--requests` concurrent requests on a fresh engine process."""
    from miles.engine.process import start_engine

    eng = start_engine(model, device=device, log_path=log, extra_args=flags, max_total_tokens=65536)
    body = lambda i: {"input_ids": [(7 * i + j) % 300 + 3 for j in range(args.prompt)],  # noqa: E731
                      "sampling_params": {"max_new_tokens": args.new, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
    try:
        post = lambda i: httpx.post(eng.url + "/generate", json=body(i), timeout=600).json()  # noqa: E731
        post(0)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            outs = list(pool.map(post, range(args.requests)))
        wall = time.perf_counter() - start
    finally:
        eng.stop()
    assert all(len(o["output_ids"]) == args.new for o in outs), "a request ended early"
    return args.requests * args.new / wall


def _net(model: str, device: str, on: bool):
    """transformers' model as the FSDP trainer builds it, the invariant forward installed when `on`."""
    from transformers import AutoModelForCausalLM

    from miles.train.fsdp import true_on_policy

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to(device)
    if on:
        true_on_policy.install(net)
    return net


def _train_step(net, device: str, on: bool, shape: str):
    """One packed row's forward + backward: `shape` = SEQSxLEN, the log-probs of every next token."""
    from miles.train.fsdp import true_on_policy
    from miles.train.losses.fused_logprob import token_logprobs_entropy

    n, length = (int(v) for v in shape.split("x"))
    ids = torch.randint(3, 300, (1, n * length), device=device)
    pos = torch.arange(length, device=device).repeat(n)[None]
    rows, targets = torch.arange(n * length - 1, device=device), ids[0, 1:]

    def step():
        net.zero_grad(set_to_none=True)
        logits = net(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        if on:
            logp = true_on_policy.logprobs(logits, rows, targets, 1.0)
        else:
            logp = token_logprobs_entropy(logits, rows, targets)[0]
        logp.mean().backward()

    return step


def train_step_s(model: str, device: str, args) -> dict[str, list[float]]:
    """Seconds of each arm's step ("mode SHAPE", "anchor SHAPE"), the arms taking turns round by round
    (so that a change in the host's load falls on both), after one untimed round each (compiles, warms
    caches)."""
    nets = {on: _net(model, device, on) for on in (True, False)}
    steps = {f"{'mode' if on else 'anchor'} {shape}": _train_step(nets[on], device, on, shape)
             for shape in args.train_rows for on in (True, False)}  # fmt: skip
    times: dict[str, list[float]] = {arm: [] for arm in steps}
    for _ in range(args.rounds + 1):
        for arm, step in steps.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            times[arm].append(time.perf_counter() - start)
    if args.profile and device == "cuda":
        for arm, step in steps.items():
            _profile(step, arm)
    return {arm: t[1:] for arm, t in times.items()}


def _profile(step, name: str) -> None:
    """One step under torch.profiler: the operations taking the most GPU time, and the GPU's busy time
    against the step's wall time (far below it: the host launching kernels bounds the step)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(f"profile {name}: wall {wall * 1e3:.1f} ms (profiled), GPU busy {busy * 1e3:.1f} ms")
    print(events.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))


def cost(args) -> dict:
    import os

    from miles.quant import invariant

    os.environ["MILES_INVARIANT_GPU"] = invariant.GPU_KERNELS = args.kernels  # engines and this trainer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.workdir)
    model = _model(args.model, work)
    graphs = [] if device == "cuda" else None
    arms = {"mode eager": FLAGS + ["--disable-cuda-graph"], "anchor eager": ["--disable-cuda-graph"]}
    if graphs is not None:  # the mode keeps CUDA graphs for dense models
        arms.update({"mode with CUDA graphs": FLAGS, "anchor with CUDA graphs": []})
    decode = {name: [decode_tok_s(model, device, f, args, work / f"engine-{i}-{r}.log")
                     for r in range(args.rounds)] for i, (name, f) in enumerate(arms.items())
              if args.only in (None, "decode")}  # fmt: skip
    train = train_step_s(model, device, args) if args.only in (None, "train") else {}
    return dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", model=args.model,
                kernels=args.kernels, decode_tok_s=decode, train_step_s=train)  # fmt: skip


def learning(args) -> dict:
    """Per seed and mode: the default recipe (recipes/default.yaml) on a synchronous schedule, TIS off;
    eval reward (held-out prompts) at every evaluation and the per-step mismatch."""
    from miles.launch.local import train_main
    from miles.metrics import read_metrics

    work = Path(args.workdir)
    rows = []
    for seed in args.seeds:
        for on in (False, True):
            name = f"top-{'on' if on else 'off'}-{seed}"
            sets = [f"run.name={name}", f"run.seed={seed}", f"run.runs_root={work / 'runs'}",
                    "rollout.schedule=sync", "train.loss.tis=off", f"train.true_on_policy={str(on).lower()}",
                    f"train.steps={args.steps}", f"eval.every_steps={args.eval_every}",
                    "train.checkpoint.every_steps=0", "run.tensorboard=false"]  # fmt: skip
            start = time.perf_counter()
            rc = train_main(str(REPO / "recipes" / "default.yaml"), sets, progress=False, overwrite=True)
            metrics = read_metrics(work / "runs" / name)
            evals = [(r["step"], r["eval/reward_mean"]) for r in metrics if "eval/reward_mean" in r]
            mismatch = [r["train/logprob_mismatch"] for r in metrics if "train/logprob_mismatch" in r]
            rows.append(dict(seed=seed, true_on_policy=on, rc=rc, evals=evals, mismatch=mismatch,
                             wall_s=time.perf_counter() - start))  # fmt: skip
    return dict(rows=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["cost", "learning"], required=True)
    p.add_argument("--model", choices=["0.5b", "tiny"], default="0.5b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--kernels", choices=["torch", "triton"], default="triton", help="MILES_INVARIANT_GPU on CUDA"
    )
    p.add_argument("--only", choices=["decode", "train"], help="cost: one half")
    p.add_argument("--profile", action="store_true", help="cost on CUDA: a profiled train step per arm")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--train-rows", nargs="+", default=["8x256", "32x256", "8x1024"], help="SEQSxLEN")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--workdir", default=tempfile.mkdtemp(prefix="bench-top-"))
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = cost(args) if args.part == "cost" else learning(args)
    result["args"] = vars(args)
    if args.part == "cost":
        for name, vals in result["decode_tok_s"].items():
            print(f"decode {name}: {statistics.median(vals):.0f} tok/s ({min(vals):.0f}-{max(vals):.0f})")
        for name, vals in result["train_step_s"].items():
            print(f"train step {name}: median {statistics.median(vals):.4f} s, fastest {min(vals):.4f} s "
                  f"(slowest {max(vals):.4f})")  # fmt: skip
        steps = result["train_step_s"]
        for shape in args.train_rows if steps else []:
            mode, anchor = steps[f"mode {shape}"], steps[f"anchor {shape}"]
            print(f"train step {shape} mode / anchor: median {statistics.median(mode) / statistics.median(anchor):.3f}x, "
                  f"fastest {min(mode) / min(anchor):.3f}x")  # fmt: skip
    else:
        print(json.dumps(result["rows"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
