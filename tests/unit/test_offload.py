"""Optimiser offload: bit-exactness against torch AdamW, checkpoints, crash safety, and user errors."""

from __future__ import annotations

import json

import pytest
import torch

from miles.config import ConfigError
from miles.config.train import TrainConfig
from miles.train.offload import OffloadedAdamW, OffloadError, build_optimizer
from miles.train.offload import checkpoint as ckpt_mod
from miles.train.offload import store as store_mod
from miles.train.offload.checkpoint import state_dir
from miles.train.offload.optimizer import STAGING_BUFFERS

# An embedding-like matrix bigger than the small buckets (split across buckets), odd sizes, a bias
# that gets no gradient on step 2, and a no-decay group.
SHAPES = [(257, 130), (130,), (64, 257), (33,), (5,)]


def make_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]


def run_steps(params, opt, first: int, last: int, grad_dtype: torch.dtype | None = None) -> None:
    """Steps first..last (1-based) with deterministic grads and an LR that changes every step."""
    for t in range(first, last + 1):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / t
        g = torch.Generator().manual_seed(100 + t)
        for i, p in enumerate(params):
            skip = t == 2 and i == 1
            grad = torch.randn(p.shape, generator=g).to(grad_dtype or p.dtype).to(p.dtype)
            p.grad = None if skip else grad
        opt.step()
        opt.zero_grad(set_to_none=True)


def reference(steps: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """torch AdamW on fp32 parameters (values and grads rounded through `dtype` first)."""
    params = [torch.nn.Parameter(p.detach().float()) for p in make_params(dtype)]
    opt = torch.optim.AdamW(groups(params), lr=1e-2, betas=(0.9, 0.99), foreach=False)
    run_steps(params, opt, 1, steps, grad_dtype=dtype)
    return [p.detach() for p in params]


def offloaded(params, mode: str, directory=None, bucket_bytes: int = 32 * 1024, **kw) -> OffloadedAdamW:
    return OffloadedAdamW(
        groups(params),
        lr=1e-2,
        betas=(0.9, 0.99),
        mode=mode,
        bucket_bytes=bucket_bytes,
        directory=str(directory) if directory else None,
        **kw,
    )


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("bucket_bytes", [32 * 1024, 200_000, 64 * 2**20])
def test_bit_identical_to_torch_adamw(tmp_path, mode, bucket_bytes):
    params = make_params()
    opt = offloaded(params, mode, tmp_path, bucket_bytes)
    run_steps(params, opt, 1, 4)
    assert same([p.detach() for p in params], reference(4))
    assert len(opt.buckets) >= (2 if bucket_bytes < 2**20 else 1)
    assert opt.steps == [4, 3, 4, 4, 4]
    if mode == "nvme":
        manifest = json.loads((tmp_path / "rank_00000" / "manifest.json").read_text())
        assert manifest["version"] == 4 and manifest["steps"] == [4, 3, 4, 4, 4]
        on_disk = sorted(p.name for p in (tmp_path / "rank_00000").glob("bucket_*"))
        assert on_disk == sorted(manifest["files"])
        assert opt.store.free.qsize() == STAGING_BUFFERS


def test_lr_scheduler_drives_the_offloaded_optimizer():
    results = []
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
        lambda ps: OffloadedAdamW(ps, lr=1e-2, weight_decay=0.1, mode="cpu", bucket_bytes=32 * 1024),
    ):
        params = make_params()
        opt = make(params)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for t in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t))
            opt.step()
            sched.step()
        results.append(([p.detach() for p in params], opt.param_groups[0]["lr"]))
    assert same(results[0][0], results[1][0]) and results[1][1] == pytest.approx(1e-2 / 4)


def test_bf16_params_keep_an_exact_fp32_master(tmp_path):
    params = make_params(torch.bfloat16)
    opt = offloaded(params, "nvme", tmp_path)
    run_steps(params, opt, 1, 3)
    assert opt.keep_master
    assert same([p.detach() for p in params], [r.to(torch.bfloat16) for r in reference(3, torch.bfloat16)])


def test_bf16_moments_are_close_and_half_the_bytes(tmp_path):
    params = make_params()
    opt = offloaded(params, "cpu", moment_dtype=torch.bfloat16)
    run_steps(params, opt, 1, 3)
    full = offloaded(make_params(), "cpu")
    assert opt.state_bytes() < 0.55 * full.state_bytes()
    for p, r in zip(params, reference(3), strict=True):
        torch.testing.assert_close(p.detach(), r, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("resume_mode", ["nvme", "cpu"])
def test_resume_from_nvme_checkpoint_is_bit_identical(tmp_path, resume_mode):
    params = make_params()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    opt = offloaded(params, "nvme", tmp_path / "a")
    run_steps(params, opt, 1, 2)
    saved_params = [p.detach().clone() for p in params]
    opt.save_state(tmp_path / "ckpt")
    run_steps(params, opt, 3, 4)  # later steps must not disturb the hard-linked checkpoint
    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = offloaded(resumed, resume_mode, tmp_path / "b")
    opt2.load_state(tmp_path / "ckpt")
    assert opt2.steps == [2, 1, 2, 2, 2]
    run_steps(resumed, opt2, 3, 4)
    assert same([p.detach() for p in resumed], reference(4))


def _fail_after(monkeypatch, module, n_ok: int) -> None:
    """Make `module.write_image` fail (as a full disk would) after n_ok successful writes."""
    real, calls = module.write_image, []

    def flaky(path, image, direct):
        calls.append(path)
        if len(calls) > n_ok:
            raise OSError(28, "No space left on device (injected)")
        real(path, image, direct)

    monkeypatch.setattr(module, "write_image", flaky)


def test_crash_mid_step_leaves_last_version_trusted(tmp_path, monkeypatch):
    params = make_params()
    opt = offloaded(params, "nvme", tmp_path)
    run_steps(params, opt, 1, 2)
    opt.save_state(tmp_path / "ckpt")
    rank_dir = tmp_path / "rank_00000"
    before = {p.name: p.read_bytes() for p in rank_dir.glob("bucket_*")}
    assert len(before) >= 3
    _fail_after(monkeypatch, store_mod, 2)
    with pytest.raises(OSError, match="injected"):
        run_steps(params, opt, 3, 3)
    monkeypatch.undo()
    manifest = json.loads((rank_dir / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["steps"] == [2, 1, 2, 2, 2]
    assert {f: (rank_dir / f).read_bytes() for f in manifest["files"]} == before
    assert any(p.name.endswith(".v3.bin") for p in rank_dir.iterdir())  # partial, never named
    assert opt.store.free.qsize() == STAGING_BUFFERS
    with pytest.raises(RuntimeError, match="load_state"):
        opt.step()
    # resume: parameters from the step-2 model checkpoint, optimiser state from save_state
    resumed = [torch.nn.Parameter(t) for t in reference(2)]
    opt2 = offloaded(resumed, "nvme", tmp_path)
    assert not any(p.name.endswith(".v3.bin") for p in rank_dir.iterdir())
    opt2.load_state(tmp_path / "ckpt")
    run_steps(resumed, opt2, 3, 4)
    assert same([p.detach() for p in resumed], reference(4))


def test_interrupted_save_is_not_trusted(tmp_path, monkeypatch):
    params = make_params()
    opt = offloaded(params, "cpu")
    run_steps(params, opt, 1, 1)
    opt.save_state(tmp_path / "ckpt")
    _fail_after(monkeypatch, ckpt_mod, 1)
    with pytest.raises(OSError, match="injected"):
        opt.save_state(tmp_path / "ckpt")
    with pytest.raises(OffloadError, match="incomplete"):
        offloaded(make_params(), "cpu").load_state(tmp_path / "ckpt")


def test_load_refuses_another_layout(tmp_path):
    params = make_params()
    opt = offloaded(params, "cpu", bucket_bytes=32 * 1024)
    run_steps(params, opt, 1, 1)
    opt.save_state(tmp_path)
    other = offloaded(make_params(), "cpu", bucket_bytes=64 * 1024)
    with pytest.raises(OffloadError, match="offload_bucket_mb"):
        other.load_state(tmp_path)
    assert state_dir(tmp_path, 0).is_dir()


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**kw)


def test_config_errors_name_the_key(tmp_path):
    params = make_params()
    with pytest.raises(OffloadError, match="train.offload_dir"):
        build_optimizer(params, _cfg(optimizer_offload="nvme"), rank=0)
    with pytest.raises(OffloadError, match="does not exist"):
        build_optimizer(params, _cfg(optimizer_offload="nvme", offload_dir=str(tmp_path / "no")), 0)
    with pytest.raises(OffloadError, match="offload_bucket_mb"):
        build_optimizer(params, _cfg(optimizer_offload="cpu", offload_bucket_mb=0), 0)
    with pytest.raises(OffloadError, match="optimizer_offload"):
        build_optimizer(params, _cfg(optimizer_offload="none"), 0)
    assert issubclass(OffloadError, ConfigError) and issubclass(OffloadError, ValueError)
    opt = build_optimizer(params, _cfg(optimizer_offload="nvme", offload_dir=str(tmp_path)), rank=3)
    assert (tmp_path / "rank_00003").is_dir() and isinstance(opt, torch.optim.Optimizer)
