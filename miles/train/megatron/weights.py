"""Full, HF-named weights out of a tensor/pipeline-parallel GPTModel, streamed in bounded buckets.

Each parameter is rebuilt where it lives: the tensor-parallel slices are all-gathered inside the TP
group (convert.tp_unshard puts fused tensors back together), then the owning pipeline stage
broadcasts the full tensor to the other stages; an MoE layer's experts are all-gathered over the
expert-parallel group and renamed by their global index. Every rank therefore yields the same stream
and must consume it to the end (the loop is collective). Data-parallel replicas need no traffic: after
an optimiser step Megatron's distributed optimizer has already all-gathered the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from miles.train.megatron import convert
from miles.train.megatron import model as M
from miles.weights.bucket import iter_buckets

Bucket = list[tuple[str, torch.Tensor]]


def _tp_full(name: str, p: torch.Tensor, s: convert.Shapes) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    size = ps.get_tensor_model_parallel_world_size()
    if size == 1 or convert._TP_DIM.get(convert._suffix(name)) is None:
        return p.detach()
    shards = [torch.empty_like(p) for _ in range(size)]
    dist.all_gather(shards, p.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return convert.tp_unshard(name, shards, s)


def iter_megatron_full(
    gpt: torch.nn.Module,
    s: convert.Shapes,
    keep: Callable[[str], bool] | None = None,
    offset: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, full tensor) for every parameter (and router expert bias) of every stage (those whose name `keep`
    accepts, given), stage by stage; experts by their global index, gathered from the expert-parallel
    ranks."""
    from megatron.core import parallel_state as ps

    offset = M.layer_offset(gpt) if offset is None else offset  # a model naming layers globally: 0
    # parameters, and the buffers a checkpoint holds: DeepSeek's router correction bias and
    # DeepSeek-V4's hash-routing table
    held = [
        *gpt.named_parameters(),
        *((n, b) for n, b in gpt.named_buffers() if n.endswith(("router.expert_bias", "router.tid2eid"))),
    ]
    mine = [(convert.to_global(n, offset), p) for n, p in held]
    if s.tied:  # the last stage's copy of the tied embedding is not a weight of its own
        mine = [(n, p) for n, p in mine if n != "output_layer.weight"]
    if keep is not None:
        mine = [(n, p) for n, p in mine if keep(n)]
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        yield from _stage_full(mine, s)
        return
    group = ps.get_pipeline_model_parallel_group()
    ep, local = _expert_split(s)
    meta = [
        (convert.ep_to_global(n, r, local), tuple(p.shape), p.dtype)
        for n, p in mine
        for r in range(ep if convert.expert_of(n) is not None else 1)
    ]
    stages: list[Any] = [None] * pp
    dist.all_gather_object(stages, meta, group=group)
    me = ps.get_pipeline_model_parallel_rank()
    for stage, entries in enumerate(stages):
        src = dist.get_global_rank(group, stage)
        own = _stage_full(mine, s) if stage == me else None
        for name, shape, dtype in entries:
            if own is not None:
                got, full = next(own)
                assert got == name, f"stage order differs from its metadata: {got} vs {name}"
                full = full.contiguous()
            else:
                full_shape = _full_shape(name, shape, s)
                full = torch.empty(full_shape, dtype=dtype, device=torch.cuda.current_device())
            dist.broadcast(full, src=src, group=group)
            yield name, full


def _expert_split(s: convert.Shapes) -> tuple[int, int]:
    """(expert-parallel size, experts per expert-parallel rank); (1, 0) for a dense model."""
    from megatron.core import parallel_state as ps

    if not s.num_experts:
        return 1, 0
    ep = ps.get_expert_model_parallel_world_size()
    return ep, s.num_experts // ep


def _stage_full(
    mine: list[tuple[str, torch.Tensor]], s: convert.Shapes
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's parameters in full: TP slices joined; each expert weight all-gathered over the
    expert-parallel group and yielded once per expert-parallel rank, by global expert index."""
    from megatron.core import parallel_state as ps

    ep, local = _expert_split(s)
    for name, p in mine:
        full = _tp_full(name, p, s)
        if convert.expert_of(name) is None or ep == 1:
            yield name, full
            continue
        parts = [torch.empty_like(full) for _ in range(ep)]
        dist.all_gather(parts, full.contiguous(), group=ps.get_expert_model_parallel_group())
        for r, part in enumerate(parts):
            yield convert.ep_to_global(name, r, local), part


def _full_shape(name: str, shard_shape: tuple[int, ...], s: convert.Shapes) -> tuple[int, ...]:
    from megatron.core import parallel_state as ps

    dim = convert._TP_DIM.get(convert._suffix(name))
    if dim is None:
        return shard_shape
    out = list(shard_shape)
    out[dim] *= ps.get_tensor_model_parallel_world_size()
    return tuple(out)


def export_buckets(
    gpt: torch.nn.Module, hf_cfg: Any, bucket_bytes: int, contract: Any = None
) -> Iterator[Bucket]:
    """HF-named full tensors of the whole model in buckets (collective over all trainer ranks); with
    `contract` (a quantised engine's FP8 layout or packed Scheme), covered weights in its layout
    (miles/train/quant.py)."""
    from miles.train.quant import export_pairs

    s = M.shapes_of(hf_cfg)
    named = convert.iter_megatron_to_hf(iter_megatron_full(gpt, s), s)
    return iter_buckets(export_pairs(named, contract), bucket_bytes)
