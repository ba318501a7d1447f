"""Optimiser construction and the LR schedule, checked against the formulas by hand."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config.train import TrainConfig
from miles.train.optim import build_optimizer, build_scheduler, lr_factor


def test_warmup_then_constant() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=4, steps=10)
    assert [lr_factor(s, cfg) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_and_cosine_decay_to_min_lr() -> None:
    lin = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=2, steps=6, lr_decay="linear")
    assert [lr_factor(s, lin) for s in (2, 4, 6, 9)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    cos = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, steps=4, lr_decay="cosine")
    assert lr_factor(1, cos) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(4, cos) == pytest.approx(0.0)


def test_adamw_and_scheduler_drive_the_lr() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    cfg = TrainConfig(lr=0.1, warmup_steps=2, weight_decay=0.01, betas=(0.8, 0.9))
    opt = build_optimizer([p], cfg)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["weight_decay"] == 0.01
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1])


def test_offload_optimizer_is_built_by_the_offload_module(tmp_path) -> None:
    from miles.train.offload import OffloadedAdamW

    p = torch.nn.Parameter(torch.zeros(4))
    opt = build_optimizer([p], TrainConfig(optimizer_offload="cpu"), rank=0)
    assert isinstance(opt, OffloadedAdamW)
    assert callable(getattr(opt, "step", None)) and opt.param_groups
