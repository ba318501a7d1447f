"""The AdamW update of one slice of a parameter, in torch.optim.AdamW's exact order of operations.

With gradient g, step t (1-based), learning rate lr, betas (b1, b2), eps and weight decay wd:

    p   <- p * (1 - lr * wd)                       decoupled weight decay
    m   <- m + (1 - b1) * (g - m)                  first moment (lerp)
    v   <- v * b2 + (1 - b2) * g * g               second moment
    p   <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The tensor operations and the scalar arithmetic follow torch's single-tensor AdamW
(`foreach=False`, no amsgrad, no maximize) one for one, so in fp32 the result is bit-identical to
it; on CPU the foreach path gives the same bits too. Element-wise maths makes any slice of a
parameter update exactly as the whole would. Moments stored in bf16 are widened to fp32 for the
update and rounded to nearest on the way back; that mode is not bit-exact by design.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hyper:
    """AdamW hyper-parameters of one param group at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    h: Hyper,
    scratch: torch.Tensor | None = None,
) -> None:
    """Update fp32 `param`, `exp_avg`, `exp_avg_sq` in place for 1-based `step`.

    `scratch` (fp32, at least as long as param) holds the denominator instead of two temporaries;
    `sqrt(out=)` then in-place `div_`/`add_` are the same kernels, so the bits do not change.
    """
    if h.weight_decay != 0:
        param.mul_(1 - h.lr * h.weight_decay)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    t = float(step)
    bias_correction1 = 1 - h.beta1**t
    bias_correction2 = 1 - h.beta2**t
    step_size = h.lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if scratch is None:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(h.eps)
    else:
        denom = torch.sqrt(exp_avg_sq, out=scratch[: exp_avg_sq.numel()])
        denom.div_(bias_correction2_sqrt).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adamw_stored_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    h: Hyper,
    scratch: torch.Tensor | None = None,
) -> None:
    """`adamw_` for state of any storage dtype: widen to fp32, update, narrow back in place."""
    work = [t if t.dtype == torch.float32 else t.float() for t in (param, exp_avg, exp_avg_sq)]
    g = grad if grad.dtype == torch.float32 else grad.float()
    adamw_(work[0], g, work[1], work[2], step, h, scratch)
    for stored, w in zip((param, exp_avg, exp_avg_sq), work, strict=True):
        if stored is not w:
            stored.copy_(w)
