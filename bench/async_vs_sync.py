"""Fully async vs synchronous rollout, same job, long-tailed response lengths: trained samples/s.

    python -m bench.async_vs_sync [--steps 12] [--out DIR]

Runs `miles train` twice on this host with the same recipe except `rollout.schedule` (the real
embedded engine, trainer, weight sync through the distributed transport). Response lengths
follow a Pareto(alpha=0.8) tail between 8 and 512 tokens (the `longtail` task, lengths enforced with
ignore_eos), so in a synchronous step the engine waits for the longest sample of the batch while
most slots sit idle; the fully async producer refills each slot as soon as its sample ends and
generates while the trainer trains. Throughput = samples trained between the first and the last
step / wall time between them (start-up excluded).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import yaml

RECIPE = {
    "run": {"name": "bench", "seed": 0, "tensorboard": False},
    "model": {"init_tiny_if_missing": True},
    "engine": {"num_engines": 1, "max_running_requests": 32},
    "rollout": {
        "task": {"name": "longtail", "options": {"min_tokens": 8, "max_tokens": 512, "alpha": 0.8}},
        "reward": "miles.rollout.rewards:first_number",
        "prompts_per_step": 8,
        "n_samples_per_prompt": 4,
        "max_new_tokens": 512,
        "max_concurrency_per_engine": 32,
        "buffer_policy": "keep",
        "buffer_capacity_groups": 16,
        "max_staleness": 2,
    },
    "eval": {"every_steps": 0},
    "train": {"lr": 1e-4, "max_tokens_per_microbatch": 2048},
    "weights": {"transport": "distributed", "update_interval": 1, "pause_mode": "in_place"},
}


def _run(schedule: str, steps: int, root: Path, model: Path) -> dict[str, float]:
    from miles.config.loading import deep_merge
    from miles.launch.local import train_main
    from miles.metrics import read_metrics

    over = {
        "run": {"runs_root": str(root), "name": schedule},
        "model": {"path": str(model)},
        "rollout": {"schedule": schedule},
        "train": {"steps": steps},
    }
    recipe = root / f"{schedule}.yaml"
    recipe.write_text(yaml.safe_dump(deep_merge(RECIPE, over)))
    start = time.monotonic()
    rc = train_main(str(recipe), [], progress=False)
    wall = time.monotonic() - start
    if rc != 0:
        raise SystemExit(f"{schedule} run failed (exit {rc}); see {root / schedule / 'logs'}")
    recs = [r for r in read_metrics(root / schedule) if r["step"] > 0]
    first, last = recs[0], recs[-1]
    samples = sum(r["rollout/batch_samples"] for r in recs[1:])
    tokens = sum(r["rollout/batch_samples"] * r["rollout/response_len_mean"] for r in recs[1:])
    span = last["time"] - first["time"]
    return {
        "steps": float(len(recs)),
        "samples_per_s": samples / span,
        "tokens_per_s": tokens / span,
        "s_per_step": span / (len(recs) - 1),
        "mean_staleness": sum(r["staleness/mean"] for r in recs) / len(recs),
        "wall_s_incl_startup": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None, help="directory for the two runs (default: a temp dir)")
    args = p.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    results = {s: _run(s, args.steps, root, model) for s in ("sync", "async")}
    speedup = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={_cpus()}  runs in {root}")
    for s, r in results.items():
        print(f"{s:5s} " + "  ".join(f"{k}={v:.3f}" for k, v in r.items()))
    print(f"async / sync samples/s = {speedup:.2f}x")
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main())
