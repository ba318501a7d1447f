"""Full weights out of an FSDP2-sharded model, one parameter at a time, in bounded buckets.

Each sharded parameter is all-gathered on its own (`DTensor.full_tensor()`, a collective that every
rank runs in the same order), so at most one full parameter plus one bucket is alive at a time,
never a second copy of the model. Names are the Hugging Face checkpoint names; a parameter shared
by two names (tied embeddings) is sent once, under its first name.

Mixture-of-experts layers (Qwen2/3-MoE in transformers 5) hold their experts stacked in memory,
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]; checkpoints, SGLang
and the embedded engine name them per expert (`mlp.experts.<e>.{gate,up,down}_proj.weight`), so
the stacked tensors leave here split into those views (`checkpoint_names`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

_STACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def checkpoint_names(name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """A state-dict entry under its checkpoint name(s): stacked experts as per-expert views."""
    if tensor.dim() != 3 or not name.endswith(_STACKED):
        yield name, tensor
        return
    prefix = name.rsplit(".", 1)[0]
    for e in range(tensor.shape[0]):
        if name.endswith("gate_up_proj"):
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
        else:
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]


def iter_full_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) for every distinct state-dict entry, gathered one at a time (collective),
    under checkpoint names (stacked experts split per expert)."""
    seen: set[int] = set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        tensor = value.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield from checkpoint_names(name, tensor if dtype is None else tensor.to(dtype))
