"""Low precision in the trainer: the FP8 contract's fake-quant forward and its FP8 weight export.

`train.quantization = fake_quant`: every linear layer whose weight the contract covers
(`miles.quant.fp8.is_quantized_name`: attention q/k/v/o and dense MLP gate/up/down projections)
computes `F.linear(x, fake_quant(W, layout), b)`, where W is the full weight as the forward sees it
(FSDP2 has all-gathered it in model.dtype) and `layout` is `engine.quantization`. The value of
`fake_quant` is the contract's quantise -> dequantise of W, the very bytes `export_pairs` ships to
an FP8 engine, so the trainer's forward sees the engine's weights; its gradient is the identity
(straight-through), so W keeps learning in full precision. Only the module's `forward` is replaced:
parameters, names and the state dict stay as they were.

`export_pairs` turns the exported (HF name, tensor in model.dtype) stream into the wire layout of an
FP8 engine: each covered `X.weight` leaves as the contract's pair `X.weight` (float8_e4m3fn) and
`X.weight_scale_inv` (float32); everything else leaves unchanged.

`train.quantization = torchao_float8` (CUDA, FSDP only) converts the linear layers with torchao's
float8 training for speed. It has its own dynamic scales and does not reproduce the engine's
weights: it is a speed option, never the consistency mechanism.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.config import ConfigError
from miles.quant.fp8 import LAYOUTS, fake_quant, is_quantized_name, quantize_weight, scale_name


def engine_layout(plan: Any) -> str | None:
    """The FP8 layout of `engine.quantization` ("fp8_block" / "fp8_row"), or None for a bf16 engine."""
    value = plan.engine.quantization
    return value if value in LAYOUTS else None


def fake_quant_layout(plan: Any) -> str | None:
    """The layout the trainer's forward fake-quantises with (None unless train.quantization=fake_quant;
    miles.config.train.check_quantization has refused fake_quant without an FP8 engine)."""
    return engine_layout(plan) if plan.train.quantization == "fake_quant" else None


def covered_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(module name, module) of every nn.Linear whose `<name>.weight` the contract quantises."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and is_quantized_name(f"{name}.weight")
    ]


def _fake_quant_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, fake_quant(self.weight, self.fp8_layout), self.bias)


def install_fake_quant(model: nn.Module, layout: str) -> int:
    """Make every covered linear layer of `model` compute with the contract's fake-quantised weight.

    Call it before wrapping with FSDP (the module names are then the HF names). Returns how many
    layers were converted; raises when there is none (a model the contract does not cover)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown FP8 layout {layout!r}; known: {', '.join(LAYOUTS)}")
    layers = covered_linears(model)
    if not layers:
        raise ConfigError(
            f"train.quantization=fake_quant found no linear layer the FP8 contract covers in "
            f"{type(model).__name__}; set train.quantization=none"
        )
    for _, module in layers:
        module.fp8_layout = layout
        module.forward = types.MethodType(_fake_quant_forward, module)
    return len(layers)


def export_pairs(named: Iterable[tuple[str, Tensor]], layout: str | None) -> Iterator[tuple[str, Tensor]]:
    """The export stream in an FP8 engine's wire layout: each covered `X.weight` (given in model.dtype)
    as the contract's `X.weight` (float8_e4m3fn) and `X.weight_scale_inv` (float32); others unchanged.
    With layout None the stream passes through."""
    if layout is None:
        yield from named
        return
    for name, tensor in named:
        if is_quantized_name(name) and tensor.dim() == 2:
            q, scale_inv = quantize_weight(tensor, layout)
            yield name, q
            yield scale_name(name), scale_inv
        else:
            yield name, tensor


def install_torchao_float8(model: nn.Module, device: torch.device) -> int:
    """Convert the model's linear layers to torchao float8 training (CUDA only; speed, not consistency).

    lm_head and layers whose dimensions are not multiples of 16 stay as they are. Returns the number
    of converted layers."""
    if device.type != "cuda":
        raise ConfigError(
            "train.quantization=torchao_float8 runs FP8 GEMMs on CUDA GPUs only and the trainer is on "
            f"{device.type}: set train.quantization=none (or train.device=cuda)"
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError(
            "train.quantization=torchao_float8 needs torchao: install the extra (pip install "
            "'miles[torchao]') or set train.quantization=none"
        ) from e

    def keep(module: nn.Module, name: str) -> bool:
        ok = isinstance(module, nn.Linear) and "lm_head" not in name
        return ok and module.in_features % 16 == 0 and module.out_features % 16 == 0

    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig())
    return before - sum(type(m) is nn.Linear for m in model.modules())
