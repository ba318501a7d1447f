"""End-to-end GRPO steps on GPU: Miles' whole loop (engine, trainer, weight sync) timed per step.

    python3 -m bench.e2e_gpu --layout colocated --backend fsdp --steps 6 --out $OUT/e2e-colocated.json

Workload (the TRL comparison of bench/trl_grpo.py): a random-initialised model of Qwen2.5-0.5B
shapes, 32 prompts x 8 samples per step, prompts of exactly 128 random tokens, responses of exactly
512 tokens (ignore_eos), temperature 1, GRPO without KL or reference model, one optimiser update per
step, log-probs of the rollout as the old policy. The run is `miles train` with the recipe below;
numbers come from its metrics.jsonl (time/rollout_s, time/train_s, time/sync_s per step, the
first `--warmup` steps left out: CUDA graph captures and allocator growth). The training share of
a step is also given as MFU (bench/gpu_train.py's FLOP count for 256 x (prompt + completion) tokens:
the standard one over the 989 TFLOP/s datasheet peak with the LM head on the positions it runs on,
and the older all-positions figure over the measured 790 TFLOP/s). `--tag` gives repeated runs their
own run directories.

`--lora R` trains rank-R LoRA adapters (alpha 2R) on every attention and MLP projection instead of every
parameter: each push then carries the adapter alone (weights/push_bytes, weights/push_s), loaded into
the engine's adapter slot by reference (CUDA IPC), and every request runs unmerged with the adapter.

`--advantage ppo` trains with a critic (train.loss.advantage=ppo, GAE); `--teacher 1.5b` adds
on-policy distillation from a random-initialised teacher of Qwen2.5-1.5B shapes (same tokenizer) on an
embedded engine beside the student's, scoring each group while others generate (time/teacher_s).

Layouts: `colocated` (engine and trainer on one GPU, weights by CUDA IPC; with the default sync
schedule the engine releases its memory while the trainer trains, or stays resident with
`--keep-engine-memory`; with `--schedule async` both stay resident and overlap), `disaggregated` (engine on GPU 0, trainer on GPU 1, fully async with
staleness 1, weights broadcast over NCCL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml


def parity_reward(sample) -> float:
    """Fraction of even token ids in the response: a reward that differs between samples of a group."""
    ids = sample.response_ids
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


def recipe(args: argparse.Namespace, model: Path, runs_root: Path) -> dict:
    colocated = args.layout == "colocated"
    schedule = args.schedule or ("sync" if colocated else "async")
    return {
        "run": {
            "name": f"e2e-{args.layout}-{args.backend}-{schedule}"
            + ("-resident" if args.keep_engine_memory else "")
            + (f"-{args.micro_batch_layout}" if getattr(args, "micro_batch_layout", "auto") != "auto" else "")
            + (f"-{args.advantage}" if getattr(args, "advantage", "grpo") != "grpo" else "")
            + (f"-teacher{args.teacher}" if getattr(args, "teacher", None) else "")
            + (f"-lora{args.lora}" if getattr(args, "lora", None) else "")
            + (f"-{args.tag}" if args.tag else ""),
            "runs_root": str(runs_root),
            "tensorboard": False,
        },
        "model": {"path": str(model), "dtype": "bfloat16"},
        "engine": {
            "max_running_requests": 256,
            "max_total_tokens": 200_000,
            "release_memory_in_train": not args.keep_engine_memory,
        },
        "rollout": {
            "task": {
                "name": "random_tokens",
                "options": {
                    "prompt_tokens": args.prompt,
                    "response_tokens": args.completion,
                    "high": 151_000,
                },
                "eval_size": 8,
            },
            "reward": "bench.e2e_gpu:parity_reward",
            "prompts_per_step": 32,
            "n_samples_per_prompt": 8,
            "temperature": 1.0,
            "max_new_tokens": args.completion,
            "max_concurrency_per_engine": 256,
            "group_requests": True,
            "schedule": schedule,
            "max_staleness": 1,
        },
        "eval": {"every_steps": 0},
        "train": {
            "backend": args.backend,
            "steps": args.steps,
            "lr": 1e-6,
            "max_tokens_per_microbatch": args.micro_tokens,
            "micro_batch_layout": getattr(args, "micro_batch_layout", "auto"),
            "loss": {
                "old_logprobs": "rollout",
                "kl_coef": 0.0,
                "advantage": getattr(args, "advantage", "grpo"),
            },
            "critic": {"lr": 1e-6},
        },
        "weights": {
            "transport": "tensor" if colocated else "distributed",
            "bucket_mb": 1024,
            "pause_mode": "none" if schedule == "sync" else "in_place",
        },
        "launch": {"layout": args.layout},
    }


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def summarize(run_dir: Path, warmup: int) -> dict:
    from miles.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) > warmup and "time/step_s" in r]
    if not rows:
        raise SystemExit(f"no timed steps after the first {warmup} in {run_dir / 'metrics.jsonl'}")

    def med(key: str) -> float:
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) if vals else float("nan")

    keys = ["time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "time/engine_release_s"]
    keys += ["time/engine_resume_s", "weights/push_s", "weights/push_bytes", "train/logprob_mismatch"]
    keys += ["train/step_time_s"]
    optional = ["time/teacher_s", "critic/value_loss", "train/distill_reverse_kl"]
    out = {k: med(k) for k in keys}
    out.update({k: med(k) for k in optional if any(k in r for r in rows)})
    tokens = [r["rollout/response_len_mean"] * r["rollout/batch_samples"] for r in rows]
    out["generated_tokens_per_step"] = statistics.median(tokens)
    out["steps_timed"] = len(rows)
    out["steps_per_hour"] = 3600 / out["time/step_s"]
    out["mismatch_per_step"] = [r.get("train/logprob_mismatch") for r in rows]
    out["step_s_per_step"] = [r["time/step_s"] for r in rows]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=["colocated", "disaggregated"], default="colocated")
    p.add_argument("--backend", choices=["fsdp", "megatron"], default="fsdp")
    p.add_argument(
        "--schedule",
        choices=["sync", "async"],
        default=None,
        help="default: sync colocated, async disaggregated",
    )
    p.add_argument(
        "--keep-engine-memory",
        action="store_true",
        help="colocated + sync: the engine stays resident while the trainer trains",
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--micro-tokens", type=int, default=16384)
    p.add_argument("--micro-batch-layout", choices=["auto", "packed", "padded"], default="auto",
                   help="train.micro_batch_layout (Megatron)")  # fmt: skip
    p.add_argument("--workdir", default="runs/bench_e2e")
    p.add_argument("--tag", default="", help="suffix of the run name (repeated runs, one directory each)")
    p.add_argument("--out", default=None, help="JSON file for the summary")
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths: a CPU smoke test")
    p.add_argument("--advantage", choices=["grpo", "ppo"], default="grpo")
    p.add_argument("--teacher", choices=["1.5b"], default=None, help="distil from a teacher of these shapes")
    p.add_argument("--distill-mode", choices=["logprob", "topk_reverse_kl"], default="logprob")
    p.add_argument("--lora", type=int, default=None, metavar="RANK", help="train LoRA adapters of this rank")
    args = p.parse_args()

    from miles.launch.local import train_main
    from miles.models.tiny import init_random

    work = Path(args.workdir).resolve()
    model = work / ("model-tiny" if args.tiny else "model-qwen25-05b")
    if not (model / "config.json").exists():
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128) if args.tiny else None  # fmt: skip
        init_random(model, shape=shape, vocab_size=2000 if args.tiny else 151_936)
    data = recipe(args, model, work / "runs")
    if args.teacher:
        teacher = work / (f"teacher-{args.teacher}" + ("-tiny" if args.tiny else ""))
        if not (teacher / "config.json").exists():  # seed 0: the student's tokenizer
            shape = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960)  # fmt: skip
            if args.tiny:
                shape = dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128)  # fmt: skip
            init_random(teacher, shape=shape, vocab_size=2000 if args.tiny else 151_936)
        data["train"]["distill"] = {"teacher_model": str(teacher), "coef": 1.0, "mode": args.distill_mode}
    if args.lora:
        data["train"]["lora"] = {"rank": args.lora, "alpha": 2 * args.lora, "target_modules": LORA_TARGETS}
    if args.tiny:
        data["rollout"]["task"]["options"]["high"] = 2000
        data["engine"]["max_total_tokens"] = 8192
        data["model"]["dtype"] = "float32"
    path = work / f"recipe-{data['run']['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    start = time.monotonic()
    rc = train_main(str(path), progress=False)
    wall = time.monotonic() - start
    run_dir = work / "runs" / data["run"]["name"]
    if rc != 0:
        print(f"miles train failed ({rc}); logs in {run_dir / 'logs'}", file=sys.stderr)
        return rc
    summary = {
        "layout": args.layout,
        "backend": args.backend,
        "wall_s": wall,
        **summarize(run_dir, args.warmup),
    }
    if not args.tiny:
        from bench.gpu_train import mfu_figures

        n = data["rollout"]["prompts_per_step"] * data["rollout"]["n_samples_per_prompt"]
        lengths, responses = [args.prompt + args.completion] * n, [args.completion] * n
        summary["train_mfu"] = mfu_figures(args.backend, lengths, responses, summary["time/train_s"])
    print(f"\n{args.layout} / {args.backend}: {summary['steps_timed']} timed steps (median)")
    for key in ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "time/engine_release_s",
                "time/engine_resume_s", "weights/push_s", "weights/push_bytes", "train/logprob_mismatch", "time/teacher_s",
                "critic/value_loss"):  # fmt: skip
        if key in summary:
            print(f"  {key:26s} {summary[key]:.4f}")
    print(f"  {'steps/hour':26s} {summary['steps_per_hour']:.0f}")
    print(f"  {'generated tokens/step':26s} {summary['generated_tokens_per_step']:.0f}")
    if "train_mfu" in summary:
        m = summary["train_mfu"]
        print(f"  {'train MFU (989, computed)':26s} {m['mfu']:.3f}  ({m['model_tflop_per_step']:.1f} TFLOP)")
        print(f"  {'train MFU (790, all pos.)':26s} {m['mfu_all_positions_vs_790']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
