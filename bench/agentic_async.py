"""Multi-turn episodes, fully async vs synchronous rollout, long-tailed episode lengths: samples/s.

    python -m bench.agentic_async [--steps 12] [--out DIR]

Runs `miles train` twice on this host with the same recipe except `rollout.schedule` (the real
embedded engine, trainer and weight sync; every episode played by the built-in generate function
`miles.agentic.rollout:env_generate`). The environment below draws each episode's number of turns
from a Pareto(alpha=1) tail between 1 and 24, and every tool call takes 20 ms (a stand-in for a
sandboxed tool), so in a synchronous step the engine waits for the longest episode of the batch
while most slots sit idle; the fully async producer starts a new episode in each slot as soon as
one ends and keeps playing while the trainer trains. Throughput = samples trained between the
first and the last step / wall time between them (start-up excluded).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import yaml

from miles.agentic.envs.base import Observation, StepResult

RECIPE = {
    "run": {"name": "bench", "seed": 0, "tensorboard": False},
    "model": {"init_tiny_if_missing": True},
    "engine": {"num_engines": 1, "max_running_requests": 32},
    "rollout": {
        "task": {"name": "env", "eval_size": 4},
        "generate_fn": "miles.agentic.rollout:env_generate",
        "env": {
            "name": "bench.agentic_async:LongTailEpisodes",
            "options": {"max_turns": 24, "alpha": 1.0, "tool_s": 0.02},
            "render_tools": False,
            "max_episode_tokens": 900,
        },
        "prompts_per_step": 8,
        "n_samples_per_prompt": 4,
        "max_new_tokens": 16,
        "max_concurrency_per_engine": 32,
        "buffer_policy": "keep",
        "buffer_capacity_groups": 16,
        "max_staleness": 2,
    },
    "eval": {"every_steps": 0},
    "train": {"lr": 1e-4, "max_tokens_per_microbatch": 2048},
    "weights": {"transport": "distributed", "update_interval": 1, "pause_mode": "in_place"},
}


class LongTailEpisodes:
    """Episodes of a Pareto-distributed number of turns; each turn's tool call takes `tool_s`."""

    name: ClassVar[str] = "longtail_episodes"
    tools: list[dict[str, Any]] = []

    def __init__(self, max_turns: int = 24, alpha: float = 1.0, tool_s: float = 0.02) -> None:
        self.max_turns, self.alpha, self.tool_s = max_turns, alpha, tool_s
        self._left = 0

    def make_task(self, seed: int, index: int) -> dict[str, Any]:
        u = 1.0 - random.Random(f"{seed}:{index}").random()
        return {"turns": max(1, min(self.max_turns, int(u ** (-1.0 / self.alpha))))}

    async def reset(self, task: dict[str, Any]) -> Observation:
        self._left = int(task["turns"])
        return Observation([{"role": "user", "content": f"take {self._left} turns"}])

    async def step(self, action: Any) -> StepResult:
        self._left -= 1
        if self._left <= 0:
            reward = float(len(str(action)) % 2)  # arbitrary, so groups have reward variance
            return StepResult([], reward=reward, done=True, info={"success": reward})
        await asyncio.sleep(self.tool_s)
        return StepResult([{"role": "tool", "content": "ok"}], info={"tool_calls": 1, "tool_errors": 0})

    async def close(self) -> None:
        return None


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
    span = last["time"] - first["time"]
    turns = [r["agent/turns"] for r in recs if "agent/turns" in r]
    return {
        "steps": float(len(recs)),
        "samples_per_s": samples / span,
        "s_per_step": span / (len(recs) - 1),
        "turns_mean": sum(turns) / max(len(turns), 1),
        "generate_time_s": sum(r.get("agent/generate_time_s", 0.0) for r in recs) / len(recs),
        "env_time_s": sum(r.get("agent/env_time_s", 0.0) for r in recs) / len(recs),
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
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={len(os.sched_getaffinity(0))}")
    print(f"runs in {root}")
    for s, r in results.items():
        print(f"{s:5s} " + "  ".join(f"{k}={v:.3f}" for k, v in r.items()))
    print(f"async / sync multi-turn samples/s = {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
