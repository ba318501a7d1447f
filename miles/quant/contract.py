"""The run's low-precision weight contract as the plan states it, without torch.

What the launcher renders on a login node (the embedded engine's quantisation flags) and what the
trainer's and the engine's modules agree on: an FP8 layout (`fp8_block`, `fp8_row`: miles/quant/fp8.py)
or a packed format (`int4`, `mxfp8`, `nvfp4`: miles/quant/formats.py) applied to `linear` layers or to
MoE `experts`. The tensors' side of each contract lives in those modules (they import torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FP8_LAYOUTS: tuple[str, ...] = ("fp8_block", "fp8_row")
PACKED_FORMATS: tuple[str, ...] = ("int4", "mxfp8", "nvfp4")


def engine_layout(plan: Any) -> str | None:
    """The FP8 layout of `engine.quantization` ("fp8_block" / "fp8_row"), or None for any other engine."""
    value = plan.engine.quantization
    return value if value in FP8_LAYOUTS else None


def packed_modules(plan: Any) -> str | None:
    """What a packed `engine.quantization` (int4, mxfp8, nvfp4) covers, `quant_modules: auto` resolved
    from the model's config.json (experts for int4 on a MoE model, else linear); None otherwise."""
    e = plan.engine
    if e.quantization not in PACKED_FORMATS:
        return None
    if e.quant_modules != "auto":
        return e.quant_modules
    return "experts" if e.quantization == "int4" and is_moe(plan.model.path) else "linear"


def is_moe(model_path: str) -> bool:
    path = Path(model_path) / "config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts"))


def engine_quant_argv(plan: Any) -> list[str]:
    """The embedded engine's quantisation flags for the run's contract."""
    e = plan.engine
    argv = ["--quantization", e.quantization, "--fp8-min-tokens", str(e.fp8_min_tokens)]
    modules = packed_modules(plan)
    if modules is not None:
        argv += ["--quant-modules", modules, "--int4-group-size", str(e.int4_group_size)]
        argv += ["--int4-max-rows", str(e.int4_max_rows)]
    return argv
