"""Between a forward's two token orders: the packed new tokens [T, ...] of a `Batch`
(miles/engine/spec.py) and its per-(request, query) rows [B * Q, ...] (`query_index` [B, Q] points
each row at its token; padding queries, `query_pos` -1, point nowhere). Attention works per request,
everything else on the packed tokens. Pure index work: no host reads, so CUDA graphs capture it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from miles.engine.spec import Batch


def _destinations(b: Batch, T: int) -> torch.Tensor:
    """[B * Q] the packed token of each (request, query) row; padding rows go to a spare row T."""
    return torch.where(b.query_pos >= 0, b.query_index, T).reshape(-1)


def to_tokens(rows: torch.Tensor, b: Batch, T: int) -> torch.Tensor:
    """[B * Q, ...] per (request, query) rows back to the packed [T, ...] token order."""
    if b.query_index.shape[1] == 1:  # decode: query_index is arange(B), the packed order already
        return rows
    packed = rows.new_zeros(T + 1, *rows.shape[1:])
    packed[_destinations(b, T)] = rows
    return packed[:T]


def token_requests(b: Batch, T: int) -> torch.Tensor:
    """[T] the request (row of b.query_index) of each packed new token."""
    B, Q = b.query_index.shape
    if Q == 1:  # decode: one token per request, in request order
        return torch.arange(B, device=b.query_index.device)
    owner = torch.zeros(T + 1, dtype=torch.long, device=b.query_index.device)
    owner[_destinations(b, T)] = torch.arange(B, device=b.query_index.device).repeat_interleave(Q)
    return owner[:T]
