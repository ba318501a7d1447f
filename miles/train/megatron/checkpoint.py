"""Save / load the full training state of the Megatron backend under the run's checkpoint directory.

Layout of <run_dir>/checkpoints/step_N/ (step directories, `.complete` markers and pruning are shared
with the FSDP backend, miles/train/checkpoint.py):

    megatron/dist/                   megatron-core distributed checkpoint (dist_checkpointing,
                                     torch_dist): every weight, and its fp32 master copy and Adam
                                     moments (the distributed optimizer's `fully_reshardable` form),
                                     stored as one global tensor whatever the layout that wrote it;
                                     the ranks holding a piece write it in parallel; param groups and
                                     Adam's step in its common state
    megatron/model_tpT_ppP.pt        this stage's weights (its TP slice) as plain tensors, by
                                     data-parallel rank 0, for `miles export` (miles/export.py), which
                                     needs no megatron-core (with expert parallelism `_epE` is
                                     appended: ep0's file holds the whole stage with its own experts,
                                     each other expert-parallel rank's only its experts, numbered
                                     from 0 on every rank)
    megatron/rng_rankR.pt            RNG states
    trainer.pt                       step counter, the caller's `extra` and the layout that saved it
    .complete                        written last, by rank 0, after every rank has finished: the
                                     size and SHA-256 of every file above

Another layout resumes it: a global tensor carries no trace of the tensor / pipeline / data-parallel
split that wrote it, so each rank reads the slices its own layout needs. RNG states are restored
only under the layout that saved them (otherwise the fresh seeding stays).

Loading verifies the files against the marker first (with no step named, a damaged newest checkpoint
is skipped for the previous one that verifies) and is strict: a key the model asks for that the
checkpoint lacks, or one the checkpoint holds that no rank asks for, is a CheckpointError listing a
few of each with their counts. Checkpoints of the earlier per-rank format (megatron/optim_state_*.pt
without megatron/dist/) are refused with a message saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.train.checkpoint import CheckpointError, choose, gather_objects, load_error, seal, step_dir
from miles.train.megatron.convert import expert_of
from miles.train.megatron.memory import chained_optimizers as _chain

log = logging.getLogger("miles.train.checkpoint")

_META = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""How the distributed optimizer shapes its state for dist_checkpointing: per parameter, in the
parameter's global shape, so that any layout can read it back."""
_SHOWN = 5


def _megatron_dir(run_dir: str, step: int) -> Path:
    return step_dir(run_dir, step) / "megatron"


def _model_file(run_dir: str, step: int) -> Path:
    """This rank's plain per-stage weights file (for `miles export`)."""
    from megatron.core import parallel_state as ps

    tag = f"tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}"
    if ps.get_expert_model_parallel_world_size() > 1:  # each expert-parallel rank holds its own experts
        tag += f"_ep{ps.get_expert_model_parallel_rank()}"
    return _megatron_dir(run_dir, step) / f"model_{tag}.pt"


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
    }


def _rng() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _sharded(owner: Any, loading: bool) -> dict[str, Any]:
    """The sharded state dict of `owner`'s model (.gpt) and its distributed optimizer (collective);
    the owner is the backend (the policy) or its PPO critic."""
    model = owner.gpt.sharded_state_dict()
    optimizer = owner.optimizer.sharded_state_dict(model, is_loading=loading, metadata=_META)
    return {"model": model, "optimizer": optimizer}


def save(backend: Any, step: int, extra: dict[str, Any] | None) -> str:
    """Collective over all trainer ranks; returns the step directory."""
    from megatron.core import dist_checkpointing

    if not all(o.optimizer is None or o.optimizer.state for o in _chain(backend.optimizer)):
        raise CheckpointError(
            "the Megatron backend checkpoints after its first training step (megatron-core's optimizer "
            "has no state before it); save after train()"
        )
    run_dir, rank = backend.plan.run_dir, dist.get_rank()
    mg = _megatron_dir(run_dir, step)
    (mg / "dist").mkdir(parents=True, exist_ok=True)
    save_model_file(backend.gpt, run_dir, step)
    dist.barrier()  # megatron-core's writer expects its directory to exist on every rank
    dist_checkpointing.save(_sharded(backend, loading=False), str(mg / "dist"))
    critic = getattr(backend, "critic", None)
    if critic is not None:
        if rank == 0:
            (mg / "critic").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(_sharded(critic, loading=False), str(mg / "critic"))
    torch.save(_rng(), mg / f"rng_rank{rank}.pt")
    out = step_dir(run_dir, step)
    if rank == 0:
        trainer = {"step": step, "step_count": backend.step_count, "extra": extra or {}, "layout": _layout()}
        if critic is not None:
            trainer["critic_steps"] = critic.steps
        torch.save(trainer, out / "trainer.pt")
    dist.barrier()
    seal(run_dir, step, backend.plan.train.checkpoint.keep_last, dist)
    dist.barrier()
    return str(out)


def save_model_file(gpt: torch.nn.Module, run_dir: str, step: int) -> None:
    """This stage's plain weights file for `miles export` (written by one data-parallel rank of each
    stage and expert-parallel rank; the directory exists)."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size() > 1
    if (ps.get_expert_data_parallel_rank() if ep else ps.get_data_parallel_rank()) != 0:
        return
    experts_only = ep and ps.get_expert_model_parallel_rank() > 0  # ep0 holds the same dense weights
    state = {
        k: v
        for k, v in gpt.state_dict().items()
        if not k.endswith("_extra_state") and not (experts_only and expert_of(k) is None)
    }
    torch.save(state, _model_file(run_dir, step))


def load(backend: Any, step: int | None) -> dict[str, Any]:
    """Collective; verifies the checkpoint's files (None: the newest complete one that verifies), then
    restores weights, master weights, moments, RNG and the step; returns `extra`."""
    run_dir = backend.plan.run_dir
    choice = choose(run_dir, step, dist)
    for note in choice.notes if dist.get_rank() == 0 else []:
        log.warning("%s", note)
    step = choice.check()
    mg = _megatron_dir(run_dir, step)
    if not (mg / "dist").is_dir():
        raise CheckpointError(_format_problem(mg))
    try:
        trainer = _load_files(backend, run_dir, step)
    except CheckpointError:
        raise
    except Exception as exc:
        raise load_error(step, run_dir, exc) from exc
    backend.step_count = int(trainer["step_count"])
    if getattr(backend, "critic", None) is not None:
        backend.critic.steps = int(trainer["critic_steps"])
    dist.barrier()
    return trainer["extra"]


def _format_problem(mg: Path) -> str:
    if mg.is_dir() and any(mg.glob("optim_state_*.pt")):
        return (
            f"{mg} holds a Megatron checkpoint of the earlier per-rank format (optim_state_*.pt files, one "
            "per tensor/pipeline rank, no dist/), which this version does not read: resume it with the "
            "Miles version that wrote it, or start a new run directory from model.path"
        )
    return f"no Megatron checkpoint under {mg} (no dist/): was it saved by train.backend=megatron?"


def key_mismatch(in_model: set[str], in_checkpoint: set[str], where: str) -> str | None:
    """The error text for a checkpoint whose keys differ from the model's (None: they agree)."""
    missing = sorted(in_model - in_checkpoint)
    unexpected = sorted(in_checkpoint - in_model)
    if not missing and not unexpected:
        return None

    def few(keys: list[str]) -> str:
        more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
        return ", ".join(keys[:_SHOWN]) + more

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (the model has them, the checkpoint does not): {few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (in the checkpoint, not in the model): {few(unexpected)}")
    return (
        f"checkpoint {where} does not fit this model: {'; '.join(parts)}. Was it saved from the same "
        "model.path (architecture, tied embeddings, biases, qk-norm)? Resume with that model, or start "
        "a new run directory"
    )


def _load_files(backend: Any, run_dir: str, step: int) -> dict[str, Any]:

    mg = _megatron_dir(run_dir, step)
    critic = getattr(backend, "critic", None)
    if critic is not None and not (mg / "critic").is_dir():
        raise CheckpointError(
            f"checkpoint {step_dir(run_dir, step)} holds no critic, and train.loss.advantage=ppo trains one: "
            "resume it with the advantage it was written with, or start a new run (run.name)"
        )
    _load_dist(backend, str(mg / "dist"))
    if critic is not None:
        _load_dist(critic, str(mg / "critic"))
    trainer = torch.load(step_dir(run_dir, step) / "trainer.pt", weights_only=False)
    _restore_rng(_megatron_dir(run_dir, step), trainer.get("layout"))
    return trainer


def _load_dist(owner: Any, path: str) -> None:
    """Model and optimizer state of `owner` (the backend or its critic) from a dist checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _allow_group_classes(owner.optimizer)
    _ensure_optimizer_state(owner.optimizer)
    request = _sharded(owner, loading=True)
    loaded, saved_only, asked_only = dist_checkpointing.load(request, path, strict=StrictHandling.RETURN_ALL)
    # megatron-core's "missing" are keys only the checkpoint has (equal on all ranks), its
    # "unexpected" this rank's keys the checkpoint lacks; every rank decides on the same union
    asked_anywhere = {k for part in gather_objects(dist, sorted(asked_only)) for k in part}
    problem = key_mismatch(asked_anywhere, set(saved_only), path)
    if problem:
        raise CheckpointError(problem)
    owner.gpt.load_state_dict(loaded["model"], strict=True)
    _load_optimizer(owner.optimizer, loaded["optimizer"])


def _restore_rng(mg: Path, saved_layout: dict[str, int] | None) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if saved_layout != _layout():
        if dist.get_rank() == 0:
            log.info(
                "checkpoint layout %s differs from this run's %s: RNG states stay freshly seeded",
                saved_layout,
                _layout(),
            )
        return
    rng = torch.load(mg / f"rng_rank{dist.get_rank()}.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])


def _allow_group_classes(optimizer: Any) -> None:
    """megatron-core reads the common state (param groups included) with torch.load(weights_only=True);
    the hybrid CPU optimizer keeps its sub-optimizer classes in its param groups: allow those."""
    classes = {
        v
        for o in _chain(optimizer)
        if o.optimizer is not None
        for g in o.optimizer.param_groups
        for v in g.values()
        if isinstance(v, type)
    }
    torch.serialization.add_safe_globals(sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"))


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Adam's state exists only after a step, and megatron-core's loader fills existing state: a fresh
    optimizer takes one step of zero gradients at learning rate 0 first (no parameter changes; the
    step count it leaves is replaced by the checkpoint's)."""
    for opt in _chain(optimizer):
        inner = opt.optimizer
        if inner is None or inner.state:
            continue
        decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
                if decoupled:  # the hybrid CPU optimizer reads fp32 gradients from here
                    p.decoupled_grad = torch.zeros_like(p, dtype=torch.float32)
        inner.step()
        for g, lr in zip(inner.param_groups, lrs, strict=True):
            g["lr"] = lr
        inner.zero_grad(set_to_none=True)
        for g in inner.param_groups:
            for p in g["params"]:
                if decoupled:
                    p.decoupled_grad = None


def _load_optimizer(optimizer: Any, state: Any) -> None:
    """Param groups and Adam's step, then master weights and moments of this rank's shards."""
    chain = _chain(optimizer)
    parts = [state[i] for i in range(len(chain))] if len(chain) > 1 else [state]
    for opt, part in zip(chain, parts, strict=True):
        part = dict(part)
        param_state = part.pop("param_state")
        kind = part.pop("param_state_sharding_type")
        if kind != _META["distrib_optim_sharding_type"]:
            raise CheckpointError(
                f"optimizer state of sharding type {kind!r}; this version reads fully_reshardable"
            )
        opt.load_state_dict(part)
        with _steps_aside(opt.optimizer):
            opt.load_parameter_state_from_fully_reshardable(param_state)


@contextmanager
def _steps_aside(inner: Any) -> Iterator[None]:
    """megatron-core copies every tensor of a parameter's torch-Adam state from the checkpoint and has
    no `step` tensor there (the step comes with the param groups): set it aside meanwhile.

    Each parameter gets its step back as its own tensor: megatron-core's load_state_dict (without
    Transformer Engine or apex) puts one tensor in every parameter's state, and torch's Adam adds 1 to
    each parameter's step in place, so a shared one would advance once per parameter per update and
    skew Adam's bias correction from the first resumed step on."""
    kept = {p: st.pop("step") for p, st in inner.state.items() if "step" in st}
    try:
        yield
    finally:
        for p, step in kept.items():
            inner.state[p]["step"] = step.clone()
