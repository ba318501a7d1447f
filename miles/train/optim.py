"""The optimiser and learning-rate schedule of every train backend, built in one place.

`build_optimizer` returns torch's AdamW for `train.optimizer_offload = "none"`, and otherwise the
offloading optimiser of miles/train/offload/ (state on host memory or node-local NVMe), which
behaves like a torch.optim.Optimizer. The LR schedule, per training step s with peak `lr`:

    warmup (s < W):  lr * (s + 1) / W
    then, with progress p = (s - W) / max(1, S - W) clipped to [0, 1] and S = train.steps:
        constant:  lr
        linear:    min_lr + (lr - min_lr) * (1 - p)
        cosine:    min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from miles.config.train import TrainConfig


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: TrainConfig, rank: int = 0
) -> torch.optim.Optimizer:
    """AdamW over `params`, or the offloading optimiser when `cfg.optimizer_offload` is not "none"."""
    params = list(params)
    if cfg.optimizer_offload == "none":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    from miles.train.offload import build_optimizer as build_offloaded

    return build_offloaded(params, cfg, rank=rank)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak LR at training step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_decay == "constant" or cfg.lr == 0:
        return 1.0
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)))
    floor = cfg.min_lr / cfg.lr
    if cfg.lr_decay == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """The LR schedule above, stepped once per training step."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
