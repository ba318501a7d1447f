"""Offload with CUDA parameters: pinned host state, stream-overlapped copies, same bits as torch AdamW."""

from __future__ import annotations

import pytest
import torch

from miles.train.offload import OffloadedAdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(1024, 700), (700,), (300, 1024), (17,)]


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", dtype)) for s in SHAPES]


def _run(params, opt, steps: int = 4) -> None:
    for t in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / t
        g = torch.Generator().manual_seed(t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to("cuda", p.dtype)
        opt.step()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_cuda_offload_is_bit_identical(tmp_path, mode):
    ref = _params(torch.float32)
    _run(ref, torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False))
    params = _params(torch.float32)
    opt = OffloadedAdamW(
        params, lr=1e-2, weight_decay=0.1, mode=mode, bucket_bytes=2**20, directory=str(tmp_path)
    )
    _run(params, opt)
    torch.cuda.synchronize()
    assert len(opt.buckets) >= 5
    assert all(torch.equal(a, b) for a, b in zip(ref, params, strict=True))
    if mode == "cpu":
        assert all(img.is_pinned() for img in opt.store.images)


def test_cuda_bf16_params_with_offloaded_master(tmp_path):
    ref = [torch.nn.Parameter(p.detach().float()) for p in _params(torch.bfloat16)]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    params = _params(torch.bfloat16)
    opt = OffloadedAdamW(
        params, lr=1e-2, weight_decay=0.1, mode="nvme", bucket_bytes=2**20, directory=str(tmp_path)
    )
    for t in range(1, 4):
        g = torch.Generator().manual_seed(t)
        for p, r in zip(params, ref, strict=True):
            grad = torch.randn(p.shape, generator=g).to("cuda", torch.bfloat16)
            p.grad, r.grad = grad, grad.float()
        opt.step()
        ref_opt.step()
    torch.cuda.synchronize()
    assert opt.keep_master
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(ref, params, strict=True))
