"""External evaluation functions used by the eval-mode tests, loaded by dotted path like a user's.

Each receives a snapshot directory (RUN_DIR/eval/snapshots/step_N, a Hugging Face model).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml

from miles.metrics import read_metrics


def _step(snapshot: str) -> int:
    return int(json.loads((Path(snapshot) / ".complete").read_text())["step"])


def _last_step(run_dir: Path) -> int:
    return int(yaml.safe_load((run_dir / "plan.yaml").read_text())["train"]["steps"])


def tensor_stats(snapshot: str) -> dict[str, float]:
    """Loads the snapshot as a Hugging Face model would (config + index + safetensors) and reports
    its size; waits (bounded) until training has logged a later step, so the result comes late."""
    from safetensors import safe_open

    path = Path(snapshot)
    config = json.loads((path / "config.json").read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    n = 0
    for name, file in index["weight_map"].items():
        with safe_open(str(path / file), framework="pt") as f:
            n += f.get_tensor(name).numel()
    step, run_dir = _step(snapshot), path.parents[2]
    deadline = time.monotonic() + 120
    while step < _last_step(run_dir) and time.monotonic() < deadline:
        if any(r["step"] > step for r in read_metrics(run_dir)):
            break
        time.sleep(0.1)
    return {"params": float(n), "hidden_size": float(config["hidden_size"]), "snapshot_step": float(step)}


def quick(snapshot: str) -> dict[str, float]:
    """Answers at once with the snapshot's step."""
    return {"snapshot_step": float(_step(snapshot)), "eval/custom": 1.0, "note": "not a number"}


def slow(snapshot: str) -> dict[str, float]:
    """Takes 1.5 s: longer than the timeout and the overflow checks of the tests that use it."""
    time.sleep(1.5)
    return {"snapshot_step": float(_step(snapshot))}


def waits_for_the_next_step(snapshot: str) -> dict[str, float]:
    """Answers only once the evaluation of the next step has written its result (bounded)."""
    step, run_dir = _step(snapshot), Path(snapshot).parents[2]
    deadline = time.monotonic() + 120
    while not (run_dir / "eval" / f"step_{step + 1}" / "result.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result of step {step + 1}")
        time.sleep(0.05)
    return {"snapshot_step": float(step)}


def fails(snapshot: str) -> dict[str, float]:
    """An evaluation with a bug."""
    raise ValueError("eval function exploded")


def fails_at_odd_steps(snapshot: str) -> dict[str, float]:
    """Raises for snapshots of odd steps, answers for even ones."""
    if _step(snapshot) % 2:
        raise ValueError("odd step")
    return quick(snapshot)


def crashes(snapshot: str) -> dict[str, float]:
    """Its process dies without a word."""
    os._exit(3)


def not_a_dict(snapshot: str) -> list[float]:
    return [1.0]


def stats_or_fail_at_odd_steps(snapshot: str) -> dict[str, float]:
    """`tensor_stats` for even steps (late: after training moved on), a failure for odd ones."""
    if _step(snapshot) % 2:
        raise ValueError("odd step")
    return tensor_stats(snapshot)


def _run_dir_of_this_process() -> Path:
    """The trainer's run directory (`python -m miles.loop --run-dir D`)."""
    return Path(sys.argv[sys.argv.index("--run-dir") + 1])


def late_eval_reward(sample) -> float:
    """first_number; an evaluation sample (negative group id) of step s < the last step is scored
    only once training has logged a step after s, so its result comes late (bounded wait)."""
    from miles.rollout.rewards import first_number

    version = sample.weight_versions[0] if sample.weight_versions else 0
    if sample.group_id < 0:
        run_dir = _run_dir_of_this_process()
        deadline = time.monotonic() + 120
        while version < _last_step(run_dir) and time.monotonic() < deadline:
            if any(r["step"] > version for r in read_metrics(run_dir)):
                break
            time.sleep(0.1)
    return first_number(sample)
