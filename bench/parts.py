"""What the one-command GPU benchmarks (bench/fp8_gpu.py, bench/moe_gpu.py) share: the part runner
(parts selected by --part run in a fixed order, a failing part is reported and the next still runs,
--out keeps the raw numbers as each part ends), the report, and the GRPO runs of their mismatch parts."""

from __future__ import annotations

import datetime
import gc
import json
import shutil
import sys
import traceback
from argparse import Namespace
from pathlib import Path

import torch
import yaml


def free_memory() -> None:
    """Return what the finished part held: Python garbage, then the CUDA allocator's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_device(args, name: str) -> str:
    """`--smoke`: the CPU; otherwise CUDA, and a clear exit without a GPU."""
    if args.smoke:
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU (or --smoke for the CPU check of the script)")
    return "cuda"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")


def run_parts(args, order: tuple[str, ...], runners: dict) -> tuple[dict, dict[str, str]]:
    """Each part of `order` that --part selects, in that order: results[part] filled (and --out rewritten)
    as each ends; a part that raises is reported by the table and the next one still runs. Returns
    (results, with the arguments and command line; part -> error)."""
    results, errors = {"args": vars(args), "argv": sys.argv[1:]}, {}
    for part in [p for p in order if p in (args.part or order)]:
        try:
            results[part] = runners[part]()
        except Exception as exc:
            traceback.print_exc()
            errors[part] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            free_memory()
        if args.out:
            Path(args.out).write_text(json.dumps(results | {"errors": errors}, indent=1))
    return results, errors


def report(
    args, lines: list[str], sections: list[tuple[str, str, object]], results: dict, errors: dict
) -> int:
    """Print the header `lines` and one markdown section per (part, title, table function) that ran,
    keep everything in --out; the exit status: 1 when a part failed or one of its rows says "failed"."""
    for part, title, table in sections:
        if part in results or part in errors:
            body = table(results[part]) if part in results else [f"failed: {errors[part]}"]
            lines += [f"#### {title}", "", *body, ""]
    print("\n" + "\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results | {"errors": errors, "table": lines}, indent=1))
        print(f"raw numbers in {args.out}")
    rows = [r for part in results.values() if isinstance(part, list) for r in part]
    return 1 if errors or any(isinstance(r, dict) and "failed" in r for r in rows) else 0


def mismatch_recipe(args, model: Path, name: str, backend: str, steps: int, loss: dict) -> Path:
    """bench/e2e_gpu.py's colocated synchronous GRPO recipe resized by the benchmark's --mm-* arguments,
    `loss` as train.loss, no periodic checkpoint; written to WORKDIR/recipe-NAME.yaml."""
    from bench.e2e_gpu import recipe

    work = Path(args.workdir)
    shape = Namespace(layout="colocated", schedule="sync", keep_engine_memory=False, tag="",
                      prompt=args.mm_prompt, completion=args.mm_completion, backend=backend,
                      steps=steps, micro_tokens=args.micro_tokens)  # fmt: skip
    data = recipe(shape, model, work / "runs")
    data["run"].update(name=name, seed=args.seed)
    data["rollout"].update(prompts_per_step=args.mm_prompts, n_samples_per_prompt=args.mm_samples)
    data["train"]["loss"] = loss
    data["train"]["checkpoint"] = {"every_steps": 0}
    if args.smoke:
        data["engine"]["max_total_tokens"] = 8192
        data["model"]["dtype"] = "float32"
    path = work / f"recipe-{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def mismatch_run(recipe: Path, workdir: str, name: str, sets: list[str], steps: int, keys: dict) -> dict:
    """One `miles train` run of `recipe` with `sets`: a row with its command, exit code, run directory and,
    per row key of `keys`, the metric it names at every trained step; "failed" when a step is missing.
    The run's end-of-run checkpoint (unused here, large) is deleted."""
    from miles.launch.local import train_main
    from miles.metrics import read_metrics

    overrides = [f"run.name={name}", *sets]
    command = f"miles train {recipe} --overwrite " + " ".join(f"--set {s}" for s in overrides)
    print(f"mismatch: {command}", flush=True)
    rc = train_main(str(recipe), overrides, progress=False, overwrite=True)
    run_dir = Path(workdir) / "runs" / name
    done = [r for r in read_metrics(run_dir) if r.get("step", 0) > 0 and "train/logprob_mismatch" in r]
    row = dict(command=command, rc=rc, run_dir=str(run_dir))
    row.update({key: [r[metric] for r in done if metric in r] for key, metric in keys.items()})
    if rc != 0 or len(done) != steps:
        row["failed"] = f"rc {rc}, {len(done)} of {steps} steps; logs in {run_dir / 'logs'}"
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    free_memory()
    return row
