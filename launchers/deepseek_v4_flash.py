"""DeepSeek-V4 Flash RL on 4 MI355X nodes, in the layout of AMD's report, and the same job in miniature.

Full scale (`--scale full`, the default): 2 rollout nodes (one SGLang server of TP8/EP8 per node: 48
running requests, 524288 total tokens) and 2 actor nodes of Megatron TP1 PP4 EP4, 8192 tokens per
GPU. The 43 decoder layers are split unevenly over the 4 pipeline stages as in the report, 11 / 11 /
11 / 10 (the last stage, which also holds the LM head and the loss, is one layer short). Rollout
batch 32 prompts x 8 samples, context 16384, response 4096; rollout routing replay (R3: the trainer
routes every token through the experts SGLang chose) and TIS on: truncated importance weights
between the trainer's recomputed old-policy log-probs and SGLang's (`old_logprobs: recompute`; with
the rollout's own log-probs the weights would all be 1).
Optimizer state lives in host memory: the recipe sets `train.optimizer_offload: cpu`, megatron-core's
CPU optimizer, over the MI355X profile's NVMe default (`--set train.optimizer_offload=nvme` streams
that optimizer's state through the local NVMe instead, docs/megatron.md).
AIME-2024 evaluation every 10 steps, 8 samples per problem (mean@8, pass@k), in `shared` mode: on the
rollout engines right after the step's weights were pushed, so the job is AMD's 4 nodes.
`train --dedicated-eval` adds a fifth node: the trainer exports a snapshot of step 10, 20, ... and an
eval engine group of its own evaluates it while training goes on; each result lands in metrics.jsonl
at the step whose weights produced it (miles/eval/modes.py). `train --dry-run` renders and checks the
job under ./runs (unless `--set run.runs_root=...` says where) and creates nothing elsewhere. A snapshot can also be evaluated by hand or as a Slurm job of its own:
`miles eval RUN_DIR --step 20 --submit`.

Miniature (`--scale tiny`): the same job shape on one host with tiny random models written by
miles.models.tiny. `--backend fsdp` (the default) trains a tiny DeepSeek-V4 (every layer kind: sliding,
compressed-sparse and heavily compressed attention, hyper-connections, a hash-routed layer then
sqrtsoftplus top-k layers) on this host's CPU with the embedded engine, R3 and TIS, logging
|delta log p| between engine and trainer (`train/logprob_mismatch`) every step. Its task is the
default digits task (a random tiny model cannot learn the full recipe's math), evaluated on it and on
generated AIME-style problems. `--backend megatron` trains the same tiny DeepSeek-V4 with the full
recipe's trainer, Megatron with the registered DeepSeek-V4 modules (miles/train/megatron/
deepseek_v4_model.py), in bf16 on CUDA. Its layout follows `--gpus` (default: the GPUs this host
shows; 5 for `--dry-run`): with 5 or more, the full recipe's layout in small (one engine, 4 trainer
ranks: PP2 with the layers split 3 / 2, the last stage one short as at full scale, EP2, R3, TIS, CPU
optimizer offload); with fewer, PP1 EP1 on one GPU beside the engine. Files live under `--tiny-dir`
(default runs/deepseek-v4-flash-tiny): model/, train.jsonl, aime.jsonl, the recipe it writes
(recipe-<backend>.yaml) and runs/.

    python launchers/deepseek_v4_flash.py prepare-checkpoint --src HF_DIR --dst /shared/models/dsv4-flash
    python launchers/deepseek_v4_flash.py prepare-data [--src DAPO.parquet --answer-key reward_model.ground_truth]
    python launchers/deepseek_v4_flash.py prepare-eval --src aime_2024.jsonl
    python launchers/deepseek_v4_flash.py train [--dry-run] [--dedicated-eval] [--set KEY=VALUE ...]
    python launchers/deepseek_v4_flash.py train --scale tiny [--backend megatron [--gpus N] [--dry-run]]

prepare-data writes the training JSONL the recipe's `jsonl` task reads: rows {"prompt", "answer"},
the prompt asking for a `\\boxed{}` answer, which the default reward (exact_match) extracts. From
`--src` (a JSONL or Parquet file; nested columns with dots, a chat-message list takes its last user
message), or, without it, `--size` generated competition-style integer problems (nothing is
downloaded).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

MODEL_DIR = "/shared/models/deepseek-v4-flash"
DATA_FILE = "/shared/data/deepseek-v4-flash/train.jsonl"
AIME_FILE = "/shared/data/deepseek-v4-flash/aime-2024.jsonl"
TINY_DIR = "runs/deepseek-v4-flash-tiny"
GENERATED_SEED = 1
"""Seed of generated training problems (the tiny evaluation's generated AIME-style set uses seed 0)."""

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
        "mode": "shared",
        "timeout_s": 5400.0,
        "datasets": {"aime2024": {"source": "aime", "path": AIME_FILE, "samples": 8, "temperature": 1.0}},
    },
    "train": {
        "backend": "megatron",
        "steps": 100,
        "tensor_parallel": 1,
        "pipeline_parallel": 4,
        "pipeline_first_stage_layers": 11,
        "pipeline_last_stage_layers": 10,
        "expert_parallel": 4,
        "routing_replay": "rollout",
        "max_tokens_per_microbatch": 8192,
        "optimizer_offload": "cpu",
        "loss": {"tis": "truncate", "old_logprobs": "recompute"},
    },
    "launch": {
        "profile": "mi355x",
        "rollout_nodes": 2,
        "actor_nodes": 2,
        "time_limit_min": 2880,
        "sglang": {"context_length": 16384},
    },
}

TINY_ROWS = 64
"""Training rows the miniature generates."""

TINY_MEGATRON = {
    "backend": "megatron",
    "num_ranks": 4,
    "pipeline_parallel": 2,
    "pipeline_first_stage_layers": 3,
    "pipeline_last_stage_layers": 2,
    "expert_parallel": 2,
    "optimizer_offload": "cpu",
}
"""The full recipe's Megatron layout in small: 4 ranks = PP2 x DP2, EP2 over the data-parallel pair."""
TINY_MEGATRON_ONE_GPU = {
    "backend": "megatron",
    "num_ranks": 1,
    "pipeline_parallel": 1,
    "expert_parallel": 1,
    "optimizer_offload": "cpu",
}
"""The Megatron miniature on a host of fewer than 5 GPUs: one trainer rank beside the engine."""
TINY_MEGATRON_GPUS = 5
"""GPUs of TINY_MEGATRON's layout: one engine and 4 trainer ranks."""


def tiny_paths(tiny_dir: str) -> dict[str, Path]:
    """Where the miniature keeps its model, data, recipes and runs (absolute, so recipes work anywhere)."""
    root = Path(tiny_dir).resolve()
    return {
        "root": root,
        "model": root / "model",
        "data": root / "train.jsonl",
        "aime": root / "aime.jsonl",
        "runs": root / "runs",
    }


def tiny_recipe(tiny_dir: str, backend: str, gpus: int = TINY_MEGATRON_GPUS) -> dict[str, Any]:
    """The miniature: R3, TIS, |delta log p| per step and the AIME-style evaluation with tiny sizes;
    the default digits task, which a tiny model learns (module docstring); Megatron's layout by `gpus`."""
    p = tiny_paths(tiny_dir)
    train: dict[str, Any] = {
        "backend": "fsdp",
        "device": "cpu",
        "steps": 300,
        "lr": 1.0e-3,
        "grad_clip": 1.0,
        "weight_decay": 0.0,
        "max_tokens_per_microbatch": 512,
        "routing_replay": "rollout",
        "loss": {"tis": "truncate", "old_logprobs": "recompute", "entropy_coef": 0.01},
        "checkpoint": {"every_steps": 100},
    }
    if backend == "megatron":
        layout = TINY_MEGATRON if gpus >= TINY_MEGATRON_GPUS else TINY_MEGATRON_ONE_GPU
        train.update(layout, device="auto", steps=3, checkpoint={"every_steps": 3})
    # one GPU: the trainer and the engine share it, taking turns
    launch = {"layout": "colocated"} if backend == "megatron" and gpus < TINY_MEGATRON_GPUS else {}
    return {
        "run": {"name": f"deepseek-v4-flash-tiny-{backend}", "runs_root": str(p["runs"]), "seed": 0},
        "model": {
            "path": str(p["model"]),
            "dtype": "bfloat16" if backend == "megatron" else "float32",
            "init_tiny_if_missing": False,
        },
        "engine": {"num_engines": 1, "max_running_requests": 128},
        "rollout": {
            "task": {"name": "digits", "options": {"op": "last", "num_digits": 2}, "eval_size": 32},
            "reward": "miles.rollout.rewards:first_number",
            "prompts_per_step": 16,
            "n_samples_per_prompt": 8,
            "max_new_tokens": 1,
            "temperature": 1.0,
            "schedule": "sync",
        },
        "eval": {
            "every_steps": 25,
            "samples_per_prompt": 4,
            "temperature": 0.6,
            "datasets": {
                "held_out": {"source": "held_out"},
                "aime": {"source": "aime", "path": str(p["aime"]), "size": 4, "samples": 2},
            },
        },
        "train": train,
        **({"launch": launch} if launch else {}),
    }


# ---- prepare-* -------------------------------------------------------------------------------------


def _destination(dst: str) -> Path:
    """The file to write, its directory created; SystemExit naming --dst when it cannot be a file."""
    path = Path(dst)
    if path.is_dir():
        raise SystemExit(f"--dst {dst} is a directory: give a file path such as {path / 'train.jsonl'}")
    if path.suffix != ".jsonl":
        raise SystemExit(f"--dst {dst}: the recipe's task reads JSONL; give a path ending in .jsonl")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--dst {dst}: cannot create its directory {path.parent} ({e.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise SystemExit(f"--dst {dst}: directory {path.parent} is not writable; choose another --dst")
    return path


def _column(row: dict[str, Any], key: str, src: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            columns = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise SystemExit(
                f"{src}: rows have no column {key!r} (columns: {columns}); set --prompt-key/--answer-key"
            )
        value = value[part]
    return value


def _prompt_text(value: Any) -> str:
    """A prompt column as text: a string as it is, a chat-message list as its last user message."""
    if isinstance(value, list):
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise SystemExit("a chat-message prompt has no user message; set --prompt-key to a text column")
        return str(users[-1])
    return str(value)


def source_rows(src: str, prompt_key: str, answer_key: str) -> list[dict[str, str]]:
    """Rows {prompt, answer} of a local JSONL or Parquet file."""
    from miles.eval.datasets import load_rows

    rows = load_rows(src, "--src")  # ConfigError naming --src: main() prints it
    return [
        {
            "prompt": _prompt_text(_column(r, prompt_key, src)),
            "answer": str(_column(r, answer_key, src)).strip(),
        }
        for r in rows
    ]


def generated_rows(size: int, seed: int = GENERATED_SEED) -> list[dict[str, str]]:
    """`size` procedural integer problems (miles.eval.datasets' AIME-style generators) asking for a
    boxed answer; answers as plain integers, which is what exact_match compares the box with."""
    from miles.eval.datasets import BOXED_INSTRUCTION, aime_synthetic_rows

    return [
        {"prompt": BOXED_INSTRUCTION.replace("{prompt}", r["problem"]), "answer": str(int(r["answer"]))}
        for r in aime_synthetic_rows(size, seed=seed)
    ]


def prepare_data(
    dst: str, src: str | None, size: int, prompt_key: str = "prompt", answer_key: str = "answer"
) -> Path:
    """Write the training JSONL of the recipe's `jsonl` task: rows {prompt, answer}."""
    from miles.eval.datasets import write_jsonl

    if size < 1:
        raise SystemExit(f"--size {size}: give at least 1 row")
    path = _destination(dst)
    rows = source_rows(src, prompt_key, answer_key) if src else generated_rows(size)
    write_jsonl(rows, path)
    print(
        f"wrote {len(rows)} rows {{prompt, answer}} to {path}" + (f" from {src}" if src else " (generated)")
    )
    return path


def prepare_checkpoint(src: str | None, dst: str, scale: str) -> None:
    """Full scale: check that `src` is a DeepSeek-V4 checkpoint (miles/models/deepseek_v4_layout.py:
    every tensor of its config, FP8 weights with their block scales) and stage it on the shared
    filesystem (engines and trainer read it there). Tiny: write the random miniature."""
    if scale == "tiny":
        from miles.models.tiny import init_tiny

        print(f"wrote tiny deepseek_v4 model to {init_tiny(dst, arch='deepseek_v4')}")
        return
    from miles.models.deepseek_v4_layout import LayoutError, check

    try:
        layout = check(src or ".")
    except LayoutError as e:
        raise SystemExit(f"--src: {e}") from None
    shutil.copytree(src, dst, dirs_exist_ok=True)
    print(
        f"staged {src} -> {dst}: DeepSeek-V4, {layout.layers} layers, {layout.experts} experts, "
        f"{layout.tensors} tensors ({layout.fp8} FP8 weights with their scales, {layout.mtp} of MTP layers)"
    )


def prepare_eval(src: str | None, dst: str, scale: str) -> None:
    """Stage an AIME 2024 JSONL file (problem/answer columns, as published) for the evaluation; tiny
    scale writes generated problems in the same layout."""
    if scale == "tiny" and not src:
        from miles.eval.datasets import aime_synthetic_rows, write_jsonl

        path = _destination(dst)
        write_jsonl(aime_synthetic_rows(8), path)
        print(f"wrote 8 generated AIME-style problems to {path}")
        return
    if not src or not Path(src).is_file():
        raise SystemExit(
            f"--src {src} is not a file: pass the AIME 2024 JSONL (rows with problem and answer)"
        )
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    print(f"staged {src} -> {dst}")


# ---- train ----------------------------------------------------------------------------------------


def train_tiny(
    tiny_dir: str,
    backend: str,
    overrides: list[str],
    dry_run: bool,
    overwrite: bool = False,
    gpus: int | None = None,
) -> int:
    """Prepare what is missing (model, data, eval set), write the recipe and run `miles train` on this
    host (or, with dry_run, resolve and check the plan, write it beside the recipe and stop). Megatron's
    layout by `gpus` (None: this host's CUDA devices, or TINY_MEGATRON_GPUS for a dry run)."""
    import yaml

    p = tiny_paths(tiny_dir)
    if gpus is None:
        gpus = TINY_MEGATRON_GPUS if dry_run else _visible_gpus()
    if not (p["model"] / "config.json").is_file():
        prepare_checkpoint(None, str(p["model"]), "tiny")
    if not p["aime"].is_file():
        prepare_eval(None, str(p["aime"]), "tiny")
    recipe = p["root"] / f"recipe-{backend}.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tiny_dir, backend, gpus), sort_keys=False))
    flags = [*(f"--set {o}" for o in overrides), *(["--overwrite"] if overwrite else [])]
    command = " ".join(["miles train", str(recipe), *flags])
    if dry_run:
        from miles.config import resolve, write_plan

        plan = resolve(str(recipe), overrides)
        write_plan(plan, p["root"] / f"plan-{backend}.yaml")
        print(f"rendered: {recipe} (plan {p['root'] / f'plan-{backend}.yaml'}); run it with: {command}")
        return 0
    from miles.launch.local import train_main

    print(f"running: {command}")
    return train_main(str(recipe), overrides, overwrite=overwrite)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


DEDICATED_EVAL = ["eval.mode=dedicated", "eval.num_engines=1", "eval.max_in_flight=2", "eval.overflow=skip",
                  "eval.keep_snapshots=2"]  # fmt: skip
"""`--dedicated-eval`: AIME on an eval node of its own (a fifth node), evaluating step snapshots while
training goes on, instead of on the rollout engines between steps (AMD's four nodes)."""


def train(overrides: list[str], dry_run: bool, dedicated_eval: bool = False) -> int:
    from miles.launch.submit import submit

    overrides = (DEDICATED_EVAL if dedicated_eval else []) + overrides
    if dry_run and not any(o.startswith("run.runs_root=") for o in overrides):
        # a dry run writes nothing outside this checkout's runs/ unless told where
        overrides = [f"run.runs_root={Path('runs').resolve()}", *overrides]
    sub = submit(RECIPE, "mi355x", overrides, dry_run=dry_run)
    print(f"{'rendered' if dry_run else 'submitted ' + sub.job_ids[0]}: {sub.script_path}")
    from miles.train.megatron.architectures import spec_of

    print(f"trainer: megatron with the deepseek_v4 architecture ({spec_of('deepseek_v4')})")
    return 0


def _scale_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--scale", choices=["full", "tiny"], default="full", help="the full job or its miniature")
    q.add_argument("--tiny-dir", default=TINY_DIR, help="where the miniature's files live (--scale tiny)")


def _tiny_default(args: argparse.Namespace, key: str) -> str:
    return str(tiny_paths(args.tiny_dir)[key])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare-checkpoint")
    q.add_argument("--src", help="Hugging Face checkpoint directory (full scale)")
    q.add_argument("--dst")
    _scale_args(q)
    q = sub.add_parser("prepare-data")
    q.add_argument("--src", help="JSONL or Parquet dataset to convert; without it problems are generated")
    q.add_argument("--dst")
    q.add_argument("--size", type=int, help=f"generated rows (default 20000, tiny {TINY_ROWS})")
    q.add_argument("--prompt-key", default="prompt", help="prompt column of --src (dots for nested columns)")
    q.add_argument("--answer-key", default="answer", help="answer column of --src (dots for nested columns)")
    _scale_args(q)
    q = sub.add_parser("prepare-eval")
    q.add_argument("--src", help="AIME 2024 JSONL (tiny scale: optional, generated without it)")
    q.add_argument("--dst")
    _scale_args(q)
    q = sub.add_parser("train")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    q.add_argument(
        "--dry-run",
        action="store_true",
        help="render and check the job under ./runs (or run.runs_root), submit nothing",
    )
    q.add_argument(
        "--dedicated-eval",
        action="store_true",
        help="evaluate on an eval node of its own (5 nodes instead of 4)",
    )
    q.add_argument("--backend", choices=["fsdp", "megatron"], help="trainer of --scale tiny (default fsdp)")
    q.add_argument(
        "--gpus",
        type=int,
        help=f"--scale tiny --backend megatron: GPUs to lay out ({TINY_MEGATRON_GPUS}+: PP2 EP2; fewer: one "
        "trainer GPU); default this host's, or 5 with --dry-run",
    )
    q.add_argument(
        "--overwrite", action="store_true", help="--scale tiny: replace an earlier run of the recipe"
    )
    _scale_args(q)
    args = p.parse_args(argv)
    from miles.config import ConfigError

    try:
        return _run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    tiny = args.scale == "tiny"
    if args.cmd == "prepare-checkpoint":
        prepare_checkpoint(
            args.src, args.dst or (_tiny_default(args, "model") if tiny else MODEL_DIR), args.scale
        )
    elif args.cmd == "prepare-data":
        dst = args.dst or (_tiny_default(args, "data") if tiny else DATA_FILE)
        if args.src and args.size is not None:
            raise SystemExit("--size is for generated rows: leave it out with --src (every row is taken)")
        size = args.size if args.size is not None else (TINY_ROWS if tiny else 20000)
        prepare_data(dst, args.src, size, args.prompt_key, args.answer_key)
    elif args.cmd == "prepare-eval":
        prepare_eval(args.src, args.dst or (_tiny_default(args, "aime") if tiny else AIME_FILE), args.scale)
    elif tiny:
        return train_tiny(
            args.tiny_dir, args.backend or "fsdp", args.set, args.dry_run, args.overwrite, args.gpus
        )
    elif args.backend == "fsdp" or args.overwrite or args.gpus is not None:
        raise SystemExit(
            "--backend fsdp, --gpus and --overwrite are for --scale tiny; the full scale trains with "
            "megatron on the recipe's nodes"
        )
    else:
        return train(args.set, args.dry_run, args.dedicated_eval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
