"""Save / load the full training state of the Megatron backend under the run's checkpoint directory.

Layout of <run_dir>/checkpoints/step_N/ (step directories, `.complete` markers and pruning are shared
with the FSDP backend, miles/train/fsdp/checkpoint.py):

    megatron/model_tpT_ppP.pt        this stage's GPTModel state (its TP slice), by data-parallel rank 0
                                     (with expert parallelism `_epE` is appended to these names
                                     and each expert-parallel rank writes its own experts)
    megatron/optim_tpT_ppP.pt        optimizer param groups
    megatron/optim_state_tpT_ppP.pt  fp32 master weights and Adam moments, gathered from the
                                     data-parallel shards by Megatron's distributed optimizer
    megatron/rng_rankR.pt            RNG states
    trainer.pt                       step counter and the caller's `extra`, by rank 0
    .complete                        written last, by rank 0, after every rank has finished: the
                                     size and SHA-256 of every file above

Loading verifies the files against the marker first (with no step named, a damaged newest checkpoint
is skipped for the previous one that verifies) and reports a failure of torch's readers with the step
and the path (miles/train/checkpoint.py).

Resuming needs the same tensor / pipeline sizes; the data-parallel size may change.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.train.checkpoint import CheckpointError, choose, load_error, seal, step_dir

log = logging.getLogger("miles.train.checkpoint")


def _files(run_dir: str, step: int) -> tuple[Path, Path, Path]:
    from megatron.core import parallel_state as ps

    tag = f"tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}"
    if ps.get_expert_model_parallel_world_size() > 1:  # each expert-parallel rank holds its own experts
        tag += f"_ep{ps.get_expert_model_parallel_rank()}"
    d = step_dir(run_dir, step) / "megatron"
    return d / f"model_{tag}.pt", d / f"optim_{tag}.pt", d / f"optim_state_{tag}.pt"


def _rng() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def save(backend: Any, step: int, extra: dict[str, Any] | None) -> str:
    """Collective over all trainer ranks; returns the step directory."""
    from megatron.core import parallel_state as ps

    run_dir, rank = backend.plan.run_dir, dist.get_rank()
    model_f, optim_f, state_f = _files(run_dir, step)
    model_f.parent.mkdir(parents=True, exist_ok=True)
    ep = ps.get_expert_model_parallel_world_size() > 1
    if (ps.get_expert_data_parallel_rank() if ep else ps.get_data_parallel_rank()) == 0:
        state = {k: v for k, v in backend.gpt.state_dict().items() if not k.endswith("_extra_state")}
        torch.save(state, model_f)
        torch.save(backend.optimizer.state_dict(), optim_f)
    backend.optimizer.save_parameter_state(str(state_f))
    torch.save(_rng(), model_f.parent / f"rng_rank{rank}.pt")
    out = step_dir(run_dir, step)
    if rank == 0:
        torch.save({"step": step, "step_count": backend.step_count, "extra": extra or {}}, out / "trainer.pt")
    dist.barrier()
    seal(run_dir, step, backend.plan.train.checkpoint.keep_last, dist)
    dist.barrier()
    return str(out)


def _load_parameter_state(optimizer: Any, path: str) -> None:
    """Megatron's loader expects no per-parameter `step` tensor, which torch's Adam keeps: set it aside."""
    inners = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    kept = [{p: st.pop("step") for p, st in inner.state.items() if "step" in st} for inner in inners]
    try:
        optimizer.load_parameter_state(path)
    finally:
        for inner, steps in zip(inners, kept, strict=True):
            for p, step in steps.items():
                inner.state[p]["step"] = step


def load(backend: Any, step: int | None) -> dict[str, Any]:
    """Collective; verifies the checkpoint's files (None: the newest complete one that verifies), then
    restores weights, master weights, moments, RNG and the step; returns `extra`."""
    run_dir = backend.plan.run_dir
    choice = choose(run_dir, step, dist)
    for note in choice.notes if dist.get_rank() == 0 else []:
        log.warning("%s", note)
    step = choice.check()
    model_f, _, _ = _files(run_dir, step)
    if not model_f.exists():
        raise CheckpointError(
            f"no Megatron checkpoint {model_f}: was it saved by the megatron backend with the same "
            "train.tensor_parallel and train.pipeline_parallel?"
        )
    try:
        trainer = _load_files(backend, run_dir, step)
    except Exception as exc:
        raise load_error(step, run_dir, exc) from exc
    backend.step_count = int(trainer["step_count"])
    dist.barrier()
    return trainer["extra"]


def _load_files(backend: Any, run_dir: str, step: int) -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    model_f, optim_f, state_f = _files(run_dir, step)
    backend.gpt.load_state_dict(torch.load(model_f, map_location="cpu"), strict=False)
    backend.optimizer.load_state_dict(torch.load(optim_f, map_location="cpu", weights_only=False))
    _load_parameter_state(backend.optimizer, str(state_f))
    rng = torch.load(model_f.parent / f"rng_rank{dist.get_rank()}.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
    return torch.load(step_dir(run_dir, step) / "trainer.pt", weights_only=False)
