"""Causal attention over packed sequences (miles/train/varlen_attention.py) against its definition."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.varlen_attention import packed_causal_attention


def _reference(q, k, v, lengths, scale):
    """softmax(q k^T * scale) v with query i seeing key j iff j <= i in the same sequence (fp64 loops)."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(q.shape[0]):
        keys = [j for j in range(i + 1) if seq[j] == seq[i]]
        for h in range(q.shape[1]):
            kh, vh = k[keys, h // group].double(), v[keys, h // group].double()
            weights = torch.softmax(kh @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ vh
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_equals_per_sequence_causal_attention(kv_heads) -> None:
    torch.manual_seed(0)
    lengths = [3, 1, 5, 2]
    q = torch.randn(sum(lengths), 4, 8)
    k, v = torch.randn(sum(lengths), kv_heads, 8), torch.randn(sum(lengths), kv_heads, 8)
    offsets = torch.tensor([0, 3, 4, 9, 11], dtype=torch.int32)
    got = packed_causal_attention(q, k, v, offsets, max(lengths), scale=0.3)
    want = _reference(q, k, v, lengths, 0.3)
    assert got.shape == q.shape
    assert (got.double() - want).abs().max() < 1e-5
    default = packed_causal_attention(q, k, v, offsets, max(lengths))
    assert (default.double() - _reference(q, k, v, lengths, 1 / math.sqrt(8))).abs().max() < 1e-5


def test_sequences_do_not_see_each_other() -> None:
    """Changing the second sequence's keys and values leaves the first sequence's output unchanged, and
    the gradient of the first sequence's output reaches no token of the second."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(7, 2, 4, requires_grad=True) for _ in range(3))
    offsets = torch.tensor([0, 4, 7], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, offsets, 4)
    out[:4].sum().backward()
    assert k.grad[4:].abs().sum() == 0 and v.grad[4:].abs().sum() == 0
    assert k.grad[:4].abs().sum() > 0
    k2 = k.detach().clone()
    k2[4:] += 1.0
    again = packed_causal_attention(q.detach(), k2, v.detach(), offsets, 4)
    assert torch.equal(again[:4], out[:4].detach()) and not torch.equal(again[4:], out[4:].detach())
