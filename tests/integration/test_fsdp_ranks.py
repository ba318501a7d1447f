"""Real trainer ranks for the FSDP tests: a worker script and the runs the tests compare.

`run_ranks` starts N processes the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), each running this file as a script: set up the FSDP backend over gloo, perform the
job's actions (train on seeded synthetic samples, save, load, export), and rank 0 writes what it saw.
`reference_runs` performs the three runs several test files share, once per session.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

from miles.processes import free_port

WORKER_TIMEOUT_S = 240

# Trainer settings of the shared runs: tiny micro-batch budget (several packed micro-batches per
# rank, unequal counts across ranks), two mini-batches, recompute, reference KL, entropy, TIS.
TRAIN = {
    "lr": 2e-4,
    "warmup_steps": 3,
    "max_tokens_per_microbatch": 28,
    "mini_batches_per_step": 2,
    "loss": {
        "old_logprobs": "recompute",
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
        "tis": "truncate",
        "eps_clip_high": 0.28,
    },
}


def make_samples(seed: int, n_groups: int = 3, per_group: int = 3, vocab: int = 300) -> list:
    """Deterministic synthetic rollout samples (random tokens, rewards, engine log-probs)."""
    from miles.sample import Sample

    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(3, 7))]
        for i in range(per_group):
            n = rng.randint(2, 9)
            out.append(
                Sample(
                    group_id=100 * seed + g,
                    index=i,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(5, vocab) for _ in range(n)],
                    loss_mask=[1] * (n - 1) + [rng.randint(0, 1)],
                    rollout_logprobs=[-rng.uniform(5.0, 6.5) for _ in range(n)],
                    reward=float(rng.randint(0, 1)),
                )
            )
    return out


def probe_ids() -> list[int]:
    """Fixed token ids whose logits the tests compare across trainer, HF model and engine."""
    return [7, 42, 99, 13, 250, 31, 8, 77, 120, 5]


def _worker(job: dict[str, Any]) -> None:
    import torch

    from miles.cluster.distributed import teardown_distributed
    from miles.config import resolve
    from miles.train import get_backend

    plan = resolve(job["config"])
    backend = get_backend("fsdp")()
    backend.setup(plan)
    rank = backend.rank
    result: dict[str, Any] = {"metrics": [], "world_size": backend.world_size}
    for action, arg in job["actions"]:
        if action == "train":
            for seed in arg:
                result["metrics"].append(backend.train(make_samples(seed)))
        elif action == "save":
            backend.save(arg, extra={"data_position": arg * 10})
        elif action == "load":
            result["extra"] = backend.load(arg)
            result["step_after_load"] = backend.step
        elif action == "export_hf":
            backend.export_hf(arg)
    buckets = list(backend.export_weights(job["bucket_bytes"]))
    weights = {name: t.cpu() for bucket in buckets for name, t in bucket}
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([probe_ids()]), use_cache=False).logits[0]
    if rank == 0:
        result["bucket_bytes"] = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
        result["bucket_names"] = [[n for n, _ in b] for b in buckets]
        torch.save({"weights": weights, "logits": logits.cpu()}, job["out"] + ".pt")
        Path(job["out"] + ".json").write_text(json.dumps(result))
    elif any(buckets):
        raise AssertionError(f"rank {rank} received tensors from export_weights")
    teardown_distributed()


def run_ranks(world_size: int, job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run the job on `world_size` real processes; returns rank 0's result (+ tensors under 'tensors')."""
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir / "job.json"
    job_file.write_text(json.dumps(job))
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(workdir / f"rank{rank}.log", "w")  # closed in the finally below
        procs.append(
            (
                subprocess.Popen([sys.executable, __file__, str(job_file)], env=env, stdout=log, stderr=log),
                log,
            )
        )
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        if proc.returncode != 0:
            tail = (workdir / f"rank{rank}.log").read_text()[-3000:]
            raise AssertionError(f"rank {rank} exited with {proc.returncode}:\n{tail}")
    result = json.loads(Path(job["out"] + ".json").read_text())
    result["tensors"] = torch.load(job["out"] + ".pt")
    return result


def _config(model: str, run_dir: Path) -> dict[str, Any]:
    return {
        "model": {"path": model, "init_tiny_if_missing": False},
        "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
        "train": {**TRAIN, "steps": 4, "device": "cpu", "checkpoint": {"keep_last": 2}},
    }


@cache
def reference_runs(model: str, root: str) -> dict[str, Any]:
    """The shared runs: 1 rank x 4 steps; 2 ranks x 4 steps saving at 1, 2, 4; 1 rank resuming at 2."""
    root_dir = Path(root)
    bucket = 40_000
    one = run_ranks(
        1,
        {
            "config": _config(model, root_dir / "one"),
            "actions": [["train", [0, 1, 2, 3]]],
            "bucket_bytes": bucket,
            "out": root + "/one",
        },
        root_dir / "one",
    )
    two_actions = [["train", [0]], ["save", 1], ["train", [1]], ["save", 2], ["train", [2, 3]], ["save", 4]]
    two_actions.append(["export_hf", root + "/hf"])
    two = run_ranks(
        2,
        {
            "config": _config(model, root_dir / "two"),
            "actions": two_actions,
            "bucket_bytes": bucket,
            "out": root + "/two",
        },
        root_dir / "two",
    )
    resumed = run_ranks(
        1,
        {
            "config": _config(model, root_dir / "two"),
            "actions": [["load", 2], ["train", [2, 3]]],
            "bucket_bytes": bucket,
            "out": root + "/resumed",
        },
        root_dir / "resumed",
    )
    return {"one": one, "two": two, "resumed": resumed, "bucket_bytes": bucket, "root": root_dir}


if __name__ == "__main__":
    _worker(json.loads(Path(sys.argv[1]).read_text()))
    gc.freeze()  # results are written: skip the exit's collection of every torch/transformers object (~1 s)
