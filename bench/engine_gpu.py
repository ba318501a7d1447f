"""Decode throughput on one GPU: the embedded engine (bf16, CUDA graphs) vs transformers' `generate`.

    python -m bench.engine_gpu [--requests 256] [--prompt 128] [--completion 512] [--skip-hf]

Model: random-init Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate
4864, vocab 151936, tied embeddings), saved in bf16. Workload: `requests` random prompts of
`prompt` tokens, each generating exactly `completion` tokens (ignore_eos), temperature 1, top_p 1.
Throughput = generated tokens / wall seconds from submission to the last reply, prefill included.

Measured:
- engine in-process (the scheduler stepped in this thread), with and without CUDA graphs: tokens/s
  and the median wall time of a decode step at full batch;
- the GPU time of one captured decode step at full batch (CUDA events around graph replays), so
  host share = 1 - GPU time / wall step time;
- the engine process over HTTP (one batched /generate), graphs on: tokens/s end to end;
- `generate` at batch `requests`, bf16, sampling with the same temperature: tokens/s;
- `--host-phases`: the host time of each scheduler phase per step (bench/host_phases.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles.models.tiny import QWEN25_05B_SHAPE, QWEN25_EOS, QWEN25_PAD, QWEN25_VOCAB

SHAPE = dict(QWEN25_05B_SHAPE, max_position_embeddings=32768)
VOCAB, EOS, PAD = QWEN25_VOCAB, QWEN25_EOS, QWEN25_PAD


def build_model(out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import model_config

    cfg = model_config("qwen2", VOCAB, EOS, PAD, **SHAPE)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def workload(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(0, VOCAB) for _ in range(args.prompt)] for _ in range(args.requests)]


def run_in_process(model: Path, prompts, args, cuda_graph: bool) -> dict:
    from miles.engine.model import Decoder, ModelSpec, load_weights
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    spec = ModelSpec.from_dir(model)
    slots = args.requests * (args.prompt + args.completion) + 4096
    sched = Scheduler(
        Decoder(spec, load_weights(model), "cuda", torch.bfloat16),
        args.requests,
        slots,
        cuda_graph=cuda_graph,
    )

    def go(n_new: int) -> tuple[float, list[float], list[Request]]:
        sp = SamplingParams(max_new_tokens=n_new, temperature=1.0, ignore_eos=True)
        reqs = [Request(str(i), p, sp, i, frozenset()) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.submit(r)
        full_steps = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        with sched.lock:
            sched._drain_inbox()
            while True:
                full = not sched.waiting and len(sched.running) == args.requests
                t0 = time.perf_counter()
                if not sched.step():
                    break
                if full:
                    full_steps.append(time.perf_counter() - t0)
        return time.perf_counter() - start, full_steps, reqs

    go(64)  # warm-up: Triton compile; graphs of longer contexts are captured inside the timed run
    sched.slots.flush()
    wall, steps, reqs = go(args.completion)
    assert all(len(r.output) == args.completion for r in reqs)
    out = {
        "cuda_graph": cuda_graph,
        "tokens_per_s": args.requests * args.completion / wall,
        "wall_s": wall,
        "decode_step_ms_median": 1e3 * statistics.median(steps),
        "graphs_captured": len(sched.graphs.graphs) if sched.graphs else 0,
    }
    if args.profile:  # host functions of a 128-token round (graphs already captured)
        import cProfile
        import pstats

        sched.slots.flush()
        with cProfile.Profile() as host:
            go(128)
        pstats.Stats(host).sort_stats("tottime").print_stats(18)
        from torch.profiler import ProfilerActivity, profile

        sched.slots.flush()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            go(64)  # whole steps: the host's operator calls and every kernel, graph replays included
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(table.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
    if args.host_phases:  # a 128-token round with a timer around each host phase (bench/host_phases.py)
        from bench.host_phases import per_step, timed_phases

        sched.slots.flush()
        with timed_phases(sched) as totals:
            go(128)
        out["host_phases"] = per_step(totals)
        for phase, v in out["host_phases"].items():
            print(f"  {phase:<36}{v['us_per_step']:>9.1f} us/step {v['calls_per_step']:>6.2f} calls/step")
    if sched.graphs is not None:
        out["graph_step_gpu_ms"] = graph_gpu_time(sched, args)
        if args.profile:
            profile_decode(sched, args)
    sched.holdings.release_memory()
    return out


def graph_gpu_time(sched, args) -> float:
    """GPU milliseconds of one captured decode step at full batch, mid-completion context."""
    context = -(-(args.prompt + args.completion // 2) // sched.context_step) * sched.context_step
    g = sched.graphs
    inputs = torch.zeros(3, args.requests, dtype=torch.int64, device="cuda")
    inputs[2] = sched.max_running  # the padding row: writes only the scratch slot
    g.run(inputs, context)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        g.run(inputs, context)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def profile_decode(sched, args, lora_slots: torch.Tensor | None = None) -> None:
    """Print the CUDA kernels of one eager decode forward at full batch, by total time (`lora_slots`:
    each request's LoRA slot)."""
    from torch.profiler import ProfilerActivity, profile

    from miles.engine.model import Batch

    context = -(-(args.prompt + args.completion // 2) // sched.context_step) * sched.context_step
    inputs = torch.zeros(3, args.requests, dtype=torch.int64, device="cuda")
    inputs[2] = sched.max_running
    batch = Batch.decode(inputs[0], inputs[1], inputs[2], sched.table, context)
    batch.lora_slots = lora_slots  # every request writes the padding row: slots given per token
    sched.decoder.forward(batch, sched.pool)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sched.decoder.forward(batch, sched.pool)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))


def run_http(model: Path, prompts, args, log_dir: Path) -> dict:
    import httpx

    from miles.engine.process import start_engine

    slots = args.requests * (args.prompt + args.completion) + 4096
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": args.completion, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    with start_engine(
        model,
        device="cuda",
        max_running_requests=args.requests,
        max_total_tokens=slots,
        log_path=log_dir / "engine_http.log",
    ) as engine:
        httpx.post(
            engine.url + "/generate", json=body | {"sampling_params": {"max_new_tokens": 64}}, timeout=600
        )
        start = time.perf_counter()
        replies = httpx.post(engine.url + "/generate", json=body, timeout=600).json()
        wall = time.perf_counter() - start
    assert all(len(r["output_ids"]) == args.completion for r in replies)
    return {"tokens_per_s": args.requests * args.completion / wall, "wall_s": wall}


def run_hf(model: Path, prompts, args) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD)
    with torch.inference_mode():
        hf.generate(ids[:8], max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=args.completion, min_new_tokens=args.completion, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    assert out.shape == (args.requests, args.prompt + args.completion)
    return {"tokens_per_s": args.requests * args.completion / wall, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the kernels of one eager decode step")
    p.add_argument("--host-phases", action="store_true", help="time the host phases of a decode round")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "qwen2.5-0.5b-shape")
        prompts = workload(args)
        for graph in (True, False) if not args.skip_eager else (True,):
            key = "engine_graph" if graph else "engine_eager"
            results[key] = run_in_process(model, prompts, args, graph)
            torch.cuda.empty_cache()
            print(key, json.dumps(results[key]), flush=True)
        results["engine_http"] = run_http(model, prompts, args, Path(tmp))
        print("engine_http", json.dumps(results["engine_http"]), flush=True)
        if not args.skip_hf:
            results["hf_generate"] = run_hf(model, prompts, args)
            print("hf_generate", json.dumps(results["hf_generate"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    g = results["engine_graph"]
    print(f"\n{'engine (graphs) tok/s':<28}{g['tokens_per_s']:>10.0f}")
    if "engine_eager" in results:
        print(f"{'engine (eager) tok/s':<28}{results['engine_eager']['tokens_per_s']:>10.0f}")
    print(f"{'engine over HTTP tok/s':<28}{results['engine_http']['tokens_per_s']:>10.0f}")
    if "hf_generate" in results:
        print(f"{'HF generate tok/s':<28}{results['hf_generate']['tokens_per_s']:>10.0f}")
    step, gpu = g["decode_step_ms_median"], g.get("graph_step_gpu_ms", float("nan"))
    print(f"decode step at batch {args.requests}: {step:.2f} ms wall, {gpu:.2f} ms GPU (graph)")


if __name__ == "__main__":
    main()
