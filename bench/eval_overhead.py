"""What evaluation costs training: steps/s with `dedicated` evaluation every step vs no evaluation.

    python -m bench.eval_overhead [--steps 48] [--warmup-steps N] [--rounds N] [--eval-cpus 4,5]
                                  [--out DIR] [--with-shared] [--set KEY=VALUE ...]

Runs `miles train` on this host with one recipe (tiny model, one embedded rollout engine, one
trainer rank, fully async rollout, weights pushed every step) two ways: `eval.every_steps: 0`, and
`eval.mode: dedicated` with `eval.every_steps: 1` (a snapshot exported every step and evaluated on
an eval engine of its own while training goes on; eval.max_in_flight=1, overflow=skip, so training
never waits for an evaluation). `--with-shared` adds a third run evaluating every step on the
rollout engines (`shared`), which training waits for. Training steps/s = steps / wall time over
the second half of the steps, or the steps after `--warmup-steps` (start-up excluded: the engines',
the trainer's, and the eval driver's and engine's, which start with the run; check that
`first_evaluated_step` comes before the timed steps). A second ratio compares the median wall time
of one step (record to record), which one slow step moves less.

The eval engine is a process more on the same cores: on a host with fewer cores than the run's
processes (rollout engine, trainer rank, eval engine, each with its share of intra-op threads),
its compute comes out of training's, and the result measures the core budget as much as the
design. `--eval-cpus 1` gives the eval engine core 1 of its own (eval.cpus) and runs training on
the other cores in both variants, so the comparison is training on the same cores with and without
an evaluation beside it. `--rounds N` repeats both variants N times, alternating which goes first.
The core split and thread counts are printed with the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import yaml

RECIPE = {
    "run": {"name": "bench", "seed": 0, "tensorboard": False},
    "model": {"init_tiny_if_missing": True},
    "engine": {"num_engines": 1, "max_running_requests": 64},
    "rollout": {
        "task": {"name": "digits", "options": {"op": "last", "num_digits": 2}, "eval_size": 16},
        "reward": "miles.rollout.rewards:first_number",
        "prompts_per_step": 8,
        "n_samples_per_prompt": 4,
        "max_new_tokens": 4,
        "max_concurrency_per_engine": 32,
        "schedule": "async",
    },
    "eval": {"every_steps": 0, "samples_per_prompt": 2},
    "train": {"lr": 1e-4, "max_tokens_per_microbatch": 2048, "checkpoint": {"every_steps": 0}},
    "weights": {"transport": "distributed", "update_interval": 1},
}

VARIANTS = {
    "no_eval": {"eval": {"every_steps": 0}},
    "dedicated": {"eval": {"every_steps": 1, "mode": "dedicated", "max_in_flight": 1, "overflow": "skip"}},
    "shared": {"eval": {"every_steps": 1, "mode": "shared"}},
}


def _run(
    name: str, steps: int, root: Path, model: Path, overrides: list[str], tag: str = "", warmup: int = 0
) -> dict[str, float]:
    from miles.config.loading import deep_merge
    from miles.launch.local import train_main
    from miles.metrics import read_metrics

    over = {
        "run": {"runs_root": str(root), "name": name + tag},
        "model": {"path": str(model)},
        "train": {"steps": steps},
    }
    recipe = root / f"{name}{tag}.yaml"
    recipe.write_text(yaml.safe_dump(deep_merge(deep_merge(RECIPE, VARIANTS[name]), over)))
    start = time.monotonic()
    rc = train_main(str(recipe), overrides, progress=False)
    wall = time.monotonic() - start
    if rc != 0:
        raise SystemExit(f"{name} run failed (exit {rc}); see {root / name / 'logs'}")
    recs = [r for r in read_metrics(root / (name + tag)) if r["step"] > 0]
    timed = recs[warmup or len(recs) // 2 :]  # start-up (the eval engine's too) is over
    span = timed[-1]["time"] - timed[0]["time"]
    walls = [b["time"] - a["time"] for a, b in zip(timed, timed[1:], strict=False)]
    evals = [r for r in recs if "eval/pass@1" in r]
    out = {
        "steps": float(len(recs)),
        "steps_per_s": (len(timed) - 1) / span,
        "step_wall_median_s": statistics.median(walls),
        "evaluated_timed": float(sum("eval/pass@1" in r for r in timed)),
        "first_evaluated_step": float(min((r["step"] for r in evals), default=-1)),
        "evaluated_steps": float(len(evals)),
        "skipped_overflow": max((r.get("eval/skipped_overflow", 0.0) for r in recs), default=0.0),
        "wall_s_incl_startup": wall,
    }
    if evals:
        out["eval_lag_steps_mean"] = sum(r["eval/lag_steps"] for r in evals) / len(evals)
        out["eval_export_s_mean"] = sum(r["eval/export_s"] for r in evals) / len(evals)
        out["eval_duration_s_mean"] = sum(r["eval/duration_s"] for r in evals) / len(evals)
    return out


@contextlib.contextmanager
def _pinned(cores: set[int] | None):
    """Run the body (and the processes it starts) on `cores` (None: as it is); restored after."""
    before = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1, help="repeat both variants, alternating the order")
    p.add_argument(
        "--warmup-steps", type=int, default=0, help="steps left out of the timing (default: the first half)"
    )
    p.add_argument("--out", default=None, help="directory for the runs (default: a temp dir)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    p.add_argument(
        "--eval-cpus", default="", help="cores of the eval engine (e.g. 1 or 2,3); training runs on the rest"
    )
    p.add_argument(
        "--with-shared", action="store_true", help="also evaluate every step on the rollout engines"
    )
    args = p.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="miles-bench-eval-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    host = os.sched_getaffinity(0)
    eval_cpus = {int(c) for c in args.eval_cpus.split(",") if c.strip()}
    training = host - eval_cpus if eval_cpus else None
    names = ["no_eval", "dedicated"] + (["shared"] if args.with_shared else [])
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            extra = (
                [f"eval.cpus=[{','.join(map(str, sorted(eval_cpus)))}]"]
                if eval_cpus and n == "dedicated"
                else []
            )
            with _pinned(training if n != "dedicated" else None):
                results[n].append(
                    _run(n, args.steps, root, model, args.set + extra, f"_r{r + 1}", args.warmup_steps)
                )
            res = results[n][-1]  # as it comes, so a run cut short still leaves the rounds before
            print(f"{n:9s} r{r + 1} " + "  ".join(f"{k}={v:.3f}" for k, v in res.items()), flush=True)
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={sorted(host)}  runs in {root}")
    if eval_cpus:
        print(
            f"core split: training (rollout engine + trainer rank) on {sorted(training)}, eval engine on {sorted(eval_cpus)}"
        )
    threads = os.environ.get("OMP_NUM_THREADS", "?")  # derived by `miles train` for its children
    print(f"processes: rollout engine, trainer rank (+ eval engine), OMP_NUM_THREADS={threads} each")
    ratios = [
        d["steps_per_s"] / b["steps_per_s"]
        for b, d in zip(results["no_eval"], results["dedicated"], strict=True)
    ]
    print(
        "dedicated eval every step / no eval, training steps/s, per round: "
        + ", ".join(f"{x:.3f}" for x in ratios)
    )
    medians = [
        b["step_wall_median_s"] / d["step_wall_median_s"]
        for b, d in zip(results["no_eval"], results["dedicated"], strict=True)
    ]
    print(
        "the same from the median wall time of a step (no eval / dedicated), per round: "
        + ", ".join(f"{x:.3f}" for x in medians)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
