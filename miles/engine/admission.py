"""What the engine checks before anything it serves is replaced: weights (from disk, a tensor handle or
a broadcast) and LoRA adapters (from a path or from tensors).

A load is refused, and the engine goes on serving exactly as before, when:
- a file it would read is not a regular file (a FIFO, a device, a socket): opening one can block the
  reader forever, and safetensors opens its files holding the GIL, which would freeze the whole process,
  its signal handling included, so these are refused by `stat` before anything opens them;
- a floating-point tensor holds NaN or an infinity (one such value reaches every logit it touches,
  and through the prefix cache, every later request);
- an adapter's config numbers are not finite and positive (`r`, `lora_alpha`): the scale alpha / r
  multiplies every adapted output;
- (checked by the decoder, also before any copy) a name the model does not have, a shape it does not
  have, or, for a checkpoint from disk, a set of tensors that is not complete.
"""

from __future__ import annotations

import math
import stat
from pathlib import Path
from typing import Any

import torch

FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def require_regular(path: str | Path, what: str) -> Path:
    """`path` if it is a regular file (links followed); ValueError naming it otherwise."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise ValueError(f"{what} {p}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "FIFO" if stat.S_ISFIFO(mode) else "directory" if stat.S_ISDIR(mode) else "special file"
        raise ValueError(f"{what} {p} is a {kind}, not a regular file: refused (nothing was loaded)")
    return p


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """ValueError naming the first tensors of `tensors` that hold NaN or an infinity. One reduction per
    tensor, and one transfer of the verdicts to the host per device (no synchronisation per tensor)."""
    names = [n for n, t in tensors.items() if t.is_floating_point()]
    finite: dict[str, bool] = {}
    for device in {tensors[n].device for n in names}:
        on = [n for n in names if tensors[n].device == device]
        verdicts = torch.stack([torch.isfinite(_comparable(tensors[n])).all() for n in on]).cpu()
        finite.update(zip(on, verdicts.tolist(), strict=True))
    bad = [n for n in names if not finite[n]][:5]
    if bad:
        raise ValueError(f"{what}: {bad} hold NaN or infinite values; refused, the engine serves as before")


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for a float8 tensor (no isfinite kernel) its float16 copy, which keeps NaN and infinities."""
    return t.to(torch.float16) if t.dtype in FLOAT8 else t


def check_adapter_numbers(cfg: dict[str, Any]) -> None:
    """ValueError unless a PEFT config's `r` is a positive integer and `lora_alpha` a finite positive number."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"adapter_config.json: r must be a positive integer, got {r!r}")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ValueError(f"adapter_config.json: lora_alpha must be a finite positive number, got {alpha!r}")
