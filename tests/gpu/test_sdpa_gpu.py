"""The engine's masked attention (miles/engine/sdpa.py) on CUDA runs no cuDNN kernel (cuDNN would build
an execution plan for every new shape inside decode steps) and equals the math backend's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from miles.engine.sdpa import masked_sdpa

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("length", [37, 200, 1024])
def test_masked_attention_runs_no_cudnn_kernel_and_matches_math(length):
    gen = torch.Generator(device="cuda").manual_seed(length)
    q, k, v = (
        torch.randn(16, 1, rows, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        for rows in (7, length, length)
    )
    seen = (
        torch.arange(length, device="cuda")[None, :]
        <= torch.randint(0, length, (16,), device="cuda")[:, None]
    )
    mask = torch.zeros(16, 1, 7, length, device="cuda", dtype=torch.bfloat16)
    mask.masked_fill_(~seen[:, None, None, :], float("-inf"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = masked_sdpa(q, k, v, mask)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert names and not [n for n in names if "cudnn" in n.lower()], names
    with sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
