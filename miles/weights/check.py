"""check_weights: compare the weights an engine serves (/get_weights_by_name) with the trainer's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import torch

from miles.weights.transport import EngineAdmin


async def check_weights(
    engines: Sequence[EngineAdmin],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    atol: float = 0.0,
    max_rows: int | None = None,
) -> dict[str, float]:
    """Max |engine - trainer| per mismatching (engine URL, name); empty when all agree within atol.

    Compares the first `max_rows` rows of each tensor (all rows when None), in float32 after
    casting the trainer tensor to the dtype the engine reported values from.
    """
    bad: dict[str, float] = {}
    for name, tensor in named_tensors:
        rows = tensor.shape[0] if tensor.dim() else 1
        rows = rows if max_rows is None else min(rows, max_rows)
        want = tensor.detach().float().cpu()[:rows] if tensor.dim() else tensor.detach().float().cpu()
        replies = await asyncio.gather(*(e.get_weights_by_name(name, truncate_size=rows) for e in engines))
        for engine, got in zip(engines, replies, strict=True):
            got_t = torch.tensor(got, dtype=torch.float32)
            if got_t.shape != want.shape:
                bad[f"{engine.url}:{name}"] = float("inf")
                continue
            diff = (got_t - want).abs().max().item() if want.numel() else 0.0
            if diff > atol:
                bad[f"{engine.url}:{name}"] = diff
    return bad
