"""The one-launch varlen flash kernel for packed rows (miles/train/varlen_attention.py) against the exact
per-sequence path in fp32, forward and backward, at the trainer's head shapes."""

from __future__ import annotations

import pytest
import torch

from miles.train.varlen_attention import packed_causal_attention, uses_varlen_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_varlen_kernel_matches_the_exact_path_in_bf16() -> None:
    torch.manual_seed(0)
    lengths = torch.randint(16, 700, (12,)).tolist()
    total = sum(lengths)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    offsets = offsets.cuda()
    q32 = torch.randn(total, 14, 64, device="cuda")
    k32, v32 = torch.randn(total, 2, 64, device="cuda"), torch.randn(total, 2, 64, device="cuda")
    grad = torch.randn(total, 14, 64, device="cuda")
    q, k, v = (t.bfloat16().requires_grad_() for t in (q32, k32, v32))
    assert uses_varlen_kernel(q)
    out = packed_causal_attention(q, k, v, offsets, max(lengths))
    out.backward(grad.bfloat16())
    r = [t.clone().requires_grad_() for t in (q32, k32, v32)]
    ref = packed_causal_attention(*r, offsets, max(lengths))
    ref.backward(grad)
    errs = {"out": ((out.float() - ref).abs().max() / ref.abs().max()).item()}
    for name, got, want in zip("qkv", (q, k, v), r, strict=True):
        errs[f"d{name}"] = ((got.grad.float() - want.grad).abs().max() / want.grad.abs().max()).item()
    print("bf16 varlen vs fp32 per-sequence:", errs)
    assert errs["out"] < 2e-2, errs
    assert max(errs["dq"], errs["dk"], errs["dv"]) < 2e-2, errs
