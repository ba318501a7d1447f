"""DeepSeek-V4 Flash RL on 4 MI355X nodes, in the layout of AMD's report.

2 rollout nodes (one SGLang server of TP8/EP8 per node: 48 running requests, 524288 total tokens)
and 2 actor nodes (Megatron TP1 PP4, 8192 tokens per GPU, optimizer state offloaded to host memory;
the report's EP4 and its 10-layer last pipeline stage wait until MoE training and uneven pipeline
stages exist); rollout batch 32 prompts x 8 samples, context 16384,
response 4096; TIS on. AIME-2024 evaluation every 10 steps, 8 samples per problem (mean@8,
pass@k), in `dedicated` mode: the trainer exports a snapshot of step 10, 20, ... and an eval engine
group of its own evaluates it while training goes on; each result lands in metrics.jsonl at the step
whose weights produced it (miles/eval/modes.py). A snapshot can also be evaluated by hand or as a
Slurm job of its own: `miles eval RUN_DIR --step 20 --submit`.

    python launchers/deepseek_v4_flash.py prepare-checkpoint --src HF_DIR --dst /shared/models/dsv4-flash
    python launchers/deepseek_v4_flash.py prepare-data --dst /shared/data/dapo.jsonl
    python launchers/deepseek_v4_flash.py prepare-eval --src aime_2024.jsonl
    python launchers/deepseek_v4_flash.py train [--dry-run] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

MODEL_DIR = "/shared/models/deepseek-v4-flash"
DATA_FILE = "/shared/data/deepseek-v4-flash/train.jsonl"
AIME_FILE = "/shared/data/deepseek-v4-flash/aime-2024.jsonl"

RECIPE = {
    "run": {"name": "deepseek-v4-flash", "runs_root": "/shared/runs"},
    "model": {"path": MODEL_DIR, "dtype": "bfloat16", "init_tiny_if_missing": False},
    "engine": {
        "kind": "sglang",
        "tp_size": 8,
        "ep_size": 8,
        "max_running_requests": 48,
        "max_total_tokens": 524288,
        "mem_fraction_static": 0.8,
    },
    "rollout": {
        "task": {"name": "jsonl", "path": DATA_FILE},
        "prompts_per_step": 32,
        "n_samples_per_prompt": 8,
        "max_new_tokens": 4096,
    },
    "eval": {
        "every_steps": 10,
        "mode": "dedicated",
        "num_engines": 1,
        "max_in_flight": 2,
        "overflow": "skip",
        "keep_snapshots": 2,
        "timeout_s": 5400.0,
        "datasets": {"aime2024": {"source": "aime", "path": AIME_FILE, "samples": 8, "temperature": 1.0}},
    },
    "train": {
        "backend": "megatron",
        "steps": 100,
        "tensor_parallel": 1,
        "pipeline_parallel": 4,
        "max_tokens_per_microbatch": 8192,
        "optimizer_offload": "cpu",
        "loss": {"tis": "truncate"},
    },
    "launch": {
        "profile": "mi355x",
        "rollout_nodes": 2,
        "actor_nodes": 2,
        "time_limit_min": 2880,
        "sglang": {"context_length": 16384},
    },
}


def prepare_checkpoint(src: str, dst: str) -> None:
    """Stage the Hugging Face checkpoint on the shared filesystem (engines and trainer read it there)."""
    if not (Path(src) / "config.json").is_file():
        raise SystemExit(f"{src} holds no config.json: pass the Hugging Face checkpoint directory")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    print(f"staged {src} -> {dst}")


def prepare_data(dst: str) -> None:
    """Write the training prompts as JSONL rows {prompt, answer} (from a local file given with --src)."""
    raise SystemExit(f"copy a JSONL of {{prompt, answer}} rows to {dst}; no dataset is downloaded by Miles")


def prepare_eval(src: str, dst: str) -> None:
    """Stage an AIME 2024 JSONL file (problem/answer columns, as published) for the evaluation."""
    if not Path(src).is_file():
        raise SystemExit(f"{src} is not a file: pass the AIME 2024 JSONL (rows with problem and answer)")
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    print(f"staged {src} -> {dst}")


def train(overrides: list[str], dry_run: bool) -> int:
    from miles.launch.submit import submit

    sub = submit(RECIPE, "mi355x", overrides, dry_run=dry_run)
    print(f"{'rendered' if dry_run else 'submitted ' + sub.job_ids[0]}: {sub.script_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare-checkpoint")
    q.add_argument("--src", required=True)
    q.add_argument("--dst", default=MODEL_DIR)
    q = sub.add_parser("prepare-data")
    q.add_argument("--dst", default=DATA_FILE)
    q = sub.add_parser("prepare-eval")
    q.add_argument("--src", required=True)
    q.add_argument("--dst", default=AIME_FILE)
    q = sub.add_parser("train")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    q.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "prepare-checkpoint":
        prepare_checkpoint(args.src, args.dst)
    elif args.cmd == "prepare-data":
        prepare_data(args.dst)
    elif args.cmd == "prepare-eval":
        prepare_eval(args.src, args.dst)
    else:
        return train(args.set, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
