"""Compare the weights engines serve with the trainer's after a push.

`check_weights`: values read back through /get_weights_by_name, within a tolerance (bf16 engines).
`check_checksums`: byte equality through /weights_checker {"action": "checksum"} (SGLang's route and
reply shape): the engine hashes the bytes it stores per tensor (sha256 of the raw C-order bytes, 16
hex digits: `miles.weights.checksum`), the trainer hashes the bytes it sent. For FP8 engines this
is the check of the quantisation contract: the FP8 weight and its `weight_scale_inv` must arrive,
and stay, exactly as the trainer quantised them. It needs an engine that reports checksums under
the Hugging Face names it was sent (the embedded engine does; a tensor-parallel or fused-parameter
server reports its own shards and names, which cannot be compared).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

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


async def engine_checksums(engine: Any) -> dict[str, str]:
    """{name: hex} of every tensor an engine stores, from POST /weights_checker {"action": "checksum"}
    (all ranks of the reply merged). `engine` is an SGLangClient (anything with `url` and `request`)."""
    reply = (await engine.request("POST", "/weights_checker", {"action": "checksum"})).json()
    if not isinstance(reply, dict) or not reply.get("success", False):
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise RuntimeError(f"engine {engine.url}: /weights_checker checksum failed: {message}")
    out: dict[str, str] = {}
    for rank in reply.get("ranks") or []:
        out.update(rank.get("checksums") or {})
    return out


async def check_checksums(
    engines: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, str]:
    """Byte equality of every given tensor on every engine; {"<engine URL>:<name>": what differs},
    empty when each engine stores exactly the bytes of each tensor."""
    from miles.weights.checksum import checksum

    stored = await asyncio.gather(*(engine_checksums(e) for e in engines))
    bad: dict[str, str] = {}
    for name, tensor in named_tensors:
        want = checksum(tensor)
        for engine, sums in zip(engines, stored, strict=True):
            got = sums.get(name)
            if got is None:
                bad[f"{engine.url}:{name}"] = "not reported by the engine"
            elif got != want:
                bad[f"{engine.url}:{name}"] = f"engine {got} != trainer {want} ({tensor.dtype})"
    return bad
