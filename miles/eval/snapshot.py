"""Eval snapshots: the trainer's weights of one step, as a Hugging Face model directory on disk.

    RUN_DIR/eval/snapshots/step_N/  config.json, tokenizer files   (copied from model.path)
                                    model-0000i.safetensors         (one file per export bucket)
                                    model.safetensors.index.json    (tensor name -> file)
                                    .complete                       {"step": N, "export_s": ...}

The tensors are written by the disk weight transport's writer (miles.weights.disk), which builds the
directory under a temporary name and renames it when whole; the index and then the `.complete`
marker follow, the marker last. A snapshot without its marker is incomplete and never used: an
eval engine, an external function or `miles eval` only ever see complete ones. `prune` keeps the
newest `keep` evaluated snapshots and never touches one still in use.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from miles.cluster.rendezvous import write_atomic

COMPLETE = ".complete"
INDEX = "model.safetensors.index.json"


def snapshots_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "eval" / "snapshots"


def snapshot_dir(run_dir: str | Path, step: int) -> Path:
    return snapshots_root(run_dir) / f"step_{step}"


def eval_dir(run_dir: str | Path, step: int) -> Path:
    """Where the evaluation of step N keeps its outputs (result.json, logs, per-sample records)."""
    return Path(run_dir) / "eval" / f"step_{step}"


def write_index(path: Path) -> int:
    """Write the sharded-checkpoint index Hugging Face loaders expect; returns the total bytes."""
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            weight_map.update(dict.fromkeys(st.keys(), f.name))
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    write_atomic(
        path / INDEX, durable=True, data={"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    return total


def export_snapshot(buckets: Iterable[Any], run_dir: str | Path, step: int, template_dir: str | Path) -> Path:
    """Write the weights of `step` (buckets of (HF name, tensor)) as a complete snapshot; its path.

    Consumes every bucket (the export is collective on the trainer ranks). An older snapshot of the
    same step (a resumed run) is replaced."""
    from miles.weights.disk import DiskTransport

    start = time.monotonic()
    root = snapshots_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = snapshot_dir(run_dir, step)
    shutil.rmtree(final, ignore_errors=True)
    written = DiskTransport([], root, template_dir=template_dir, pause_mode=None).write(buckets, f"-{step}")
    written.rename(final)
    total = write_index(final)
    marker = {"step": step, "export_s": time.monotonic() - start, "bytes": total, "time": time.time()}
    write_atomic(final / COMPLETE, marker, durable=True)
    return final


def snapshot_from_checkpoint(run_dir: str | Path, step: int) -> Path:
    """A complete snapshot of `step` made from its training checkpoint (miles.export; a LoRA run's
    single adapter is merged), for a step that was checkpointed but never exported for evaluation;
    FileNotFoundError naming the steps that can be evaluated when there is no such checkpoint."""
    from miles.config import ConfigError
    from miles.export import export_run
    from miles.train.checkpoint import complete_steps as checkpointed

    run_dir = Path(run_dir)
    if step not in checkpointed(run_dir):
        have = sorted(set(complete_steps(run_dir)) | set(checkpointed(run_dir)))
        raise FileNotFoundError(
            f"step {step} of {run_dir} has neither an eval snapshot nor a checkpoint; steps that can be "
            f"evaluated: {', '.join(map(str, have)) or 'none'}"
        )
    root = snapshots_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    partial, final = root / f".step_{step}.partial", snapshot_dir(run_dir, step)
    shutil.rmtree(partial, ignore_errors=True)
    start = time.monotonic()
    try:
        export_run(run_dir, partial, step, merge=_has_lora(run_dir))
    except ConfigError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise FileNotFoundError(
            f"step {step}: its checkpoint cannot be exported for evaluation: {e}"
        ) from None
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    total = write_index(final)
    marker = {"step": step, "export_s": time.monotonic() - start, "bytes": total, "time": time.time()}
    write_atomic(final / COMPLETE, {**marker, "from_checkpoint": True}, durable=True)
    return final


def _has_lora(run_dir: Path) -> bool:
    from miles.config import read_plan

    return read_plan(run_dir / "plan.yaml").train.lora is not None


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The `.complete` record of a snapshot directory, or None while it is incomplete."""
    try:
        return json.loads((Path(path) / COMPLETE).read_text())
    except (OSError, ValueError):
        return None


def find_snapshot(run_dir: str | Path, step: int) -> Path:
    """The complete snapshot of `step`; FileNotFoundError naming the complete ones otherwise."""
    path = snapshot_dir(run_dir, step)
    marker = read_marker(path)
    if marker is not None and int(marker.get("step", -1)) == step:
        return path
    have = complete_steps(run_dir)
    raise FileNotFoundError(
        f"no complete eval snapshot of step {step} in {snapshots_root(run_dir)} "
        f"({'complete: ' + ', '.join(map(str, have)) if have else 'none is complete'}); snapshots are "
        "written when eval.mode is dedicated or external"
    )


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps with a complete snapshot, ascending."""
    root = snapshots_root(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for p in root.glob("step_*"):
        marker = read_marker(p)
        if marker is not None and p.name == f"step_{marker.get('step')}":
            steps.append(int(marker["step"]))
    return sorted(steps)


def prune(run_dir: str | Path, evaluated: list[int], in_use: set[int], keep: int) -> list[int]:
    """Delete evaluated snapshots beyond the newest `keep` (never one in `in_use`); the steps deleted."""
    removable = sorted(s for s in set(evaluated) if s not in in_use)
    doomed = removable[: max(0, len(removable) - keep)]
    for step in doomed:
        shutil.rmtree(snapshot_dir(run_dir, step), ignore_errors=True)
    return doomed
