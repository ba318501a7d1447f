"""Checkpoints of the FSDP backend: full training state with torch.distributed.checkpoint (DCP).

Layout of `<run_dir>/checkpoints/step_<N>/`:

    state/          DCP files: model and optimiser state as sharded DTensors. DCP stores each shard
                    with its global offsets, so a checkpoint written by R ranks loads on any R'.
    optimizer/      only with an offloading optimiser that has save_state(dir)/load_state(dir):
                    it writes its own state there and DCP holds the model alone.
    critic/         PPO only: the critic's model and optimiser state (DCP, same rules; an offloading
                    optimiser's own files in critic/optimizer/); its LR schedule is in trainer.pt
    trainer.pt      rank 0: step, LR-scheduler state, the caller's `extra` (loop state, data position)
                    (several LoRA adapters: every adapter's AdamW is in state/, every schedule here)
    rng_rank<r>.pt  per rank: torch (CPU and CUDA) and Python RNG states
    .complete       written last, by rank 0, after every rank has finished writing: the size and
                    SHA-256 of every file above (miles/train/checkpoint.py)

Only directories with `.complete` count; `keep_last` complete checkpoints are kept. Loading verifies
the files against the marker first (the newest damaged checkpoint is skipped for the previous one when
no step is named) and reports a failure of torch's readers with the step and the path. `export_hf`
writes an inference-ready Hugging Face directory (config, tokenizer, model.safetensors).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from miles.train.checkpoint import CheckpointError, choose, load_error, seal, step_dir
from miles.train.fsdp.weights import iter_full_tensors

log = logging.getLogger("miles.train.checkpoint")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _has_own_state(optimizer: torch.optim.Optimizer) -> bool:
    return callable(getattr(optimizer, "save_state", None)) and callable(
        getattr(optimizer, "load_state", None)
    )


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...],
    scheduler: Any,
    extra: dict[str, Any] | None = None,
    keep_last: int = 2,
    critic: tuple[nn.Module, torch.optim.Optimizer, Any] | None = None,
) -> Path:
    """Write the full training state of `step` (collective: every rank calls it); returns the dir.
    `critic`: PPO's (model, optimiser, LR schedule), saved beside the policy."""
    rank = dist.get_rank()
    out = step_dir(run_dir, step)
    if rank == 0 and out.exists():
        shutil.rmtree(out)  # a leftover of a crash mid-save, or a deliberate re-save of this step
    dist.barrier()
    _save_modules(out, model, optimizer)
    if critic is not None:
        _save_modules(out / "critic", critic[0], critic[1])
    torch.save(_rng_state(), out / f"rng_rank{rank}.pt")
    if rank == 0:
        trainer = {"step": step, "scheduler": scheduler.state_dict(), "extra": extra or {}}
        if critic is not None:
            trainer["critic_scheduler"] = critic[2].state_dict()
        torch.save(trainer, out / "trainer.pt")
    dist.barrier()
    seal(run_dir, step, keep_last, dist)
    dist.barrier()
    return out


def _save_modules(out: Path, model: nn.Module, optimizer: Any) -> None:
    if _has_own_state(optimizer):
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(out / "state"))
        optimizer.save_state(str(out / "optimizer"))
    else:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "state"))


def _load_modules(src: Path, model: nn.Module, optimizer: Any) -> None:
    if _has_own_state(optimizer):
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(src / "state"))
        set_model_state_dict(model, state["model"])
        optimizer.load_state(str(src / "optimizer"))
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(src / "state"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_checkpoint(
    run_dir: str | Path,
    step: int | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...],
    scheduler: Any,
    critic: tuple[nn.Module, torch.optim.Optimizer, Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Restore the state of `step` after verifying its files (None: the newest complete checkpoint
    that verifies); returns (step, extra). Collective. Raises NoCheckpointError / CheckpointError."""
    group = dist if dist.is_initialized() else None
    choice = choose(run_dir, step, group)
    for note in choice.notes if group is None or dist.get_rank() == 0 else []:
        log.warning("%s", note)
    step = choice.check()
    try:
        trainer = _load_files(step_dir(run_dir, step), model, optimizer, scheduler, critic)
    except CheckpointError:
        raise
    except Exception as exc:
        raise load_error(step, run_dir, exc) from exc
    dist.barrier()
    return int(trainer["step"]), trainer["extra"]


def _load_files(
    src: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...],
    scheduler: Any,
    critic: tuple[nn.Module, torch.optim.Optimizer, Any] | None,
) -> dict:
    if critic is not None and not (src / "critic").is_dir():
        raise CheckpointError(
            f"checkpoint {src} holds no critic, and train.loss.advantage=ppo trains one: resume it with "
            "the advantage it was written with, or start a new run (run.name)"
        )
    _load_modules(src, model, optimizer)
    trainer = torch.load(src / "trainer.pt", weights_only=False)
    scheduler.load_state_dict(trainer["scheduler"])
    if critic is not None:
        _load_modules(src / "critic", critic[0], critic[1])
        critic[2].load_state_dict(trainer["critic_scheduler"])
    rng_file = src / f"rng_rank{dist.get_rank()}.pt"
    _set_rng_state(torch.load(rng_file if rng_file.exists() else src / "rng_rank0.pt", weights_only=False))
    return trainer


def export_hf(model: nn.Module, model_path: str | Path, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Write config, tokenizer and model.safetensors of the current weights (collective; rank 0 writes)."""
    from transformers import AutoTokenizer

    rank = dist.get_rank()
    out = Path(out_dir)
    tensors = {}
    for name, tensor in iter_full_tensors(model, dtype):
        if rank == 0:
            tensors[name] = tensor.cpu().clone()  # per-expert views of one stacked tensor share storage
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / "model.safetensors")
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(out)
    dist.barrier()
    return out
