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

Packed engines (`engine.quantization` int4 / mxfp8 / nvfp4; `train.quantization` fake_quant, or
int4_qat for int4): the same, with the run's Scheme (miles/quant/formats.py) deciding what is covered
and how it is quantised; covered MoE experts, which transformers 5 holds as stacked `gate_up_proj`
[E, 2I, H] / `down_proj` [E, H, I] parameters, forward with each stack fake-quantised row-block by
row-block (for nvfp4 per expert and per gate / up half: its tensor scale is per HF weight), the
parameter swapped in for the duration of the experts' forward only. `export_pairs` ships each covered
weight as the format's parts.

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
from miles.quant.formats import Scheme, engine_contract
from miles.quant.fp8 import LAYOUTS, fake_quant, is_quantized_name, quantize_weight, scale_name


def fake_quant_layout(plan: Any) -> str | Scheme | None:
    """The contract the trainer's forward fake-quantises with (None unless train.quantization is
    fake_quant or int4_qat; miles.config.train.check_quantization has refused those without a
    quantised engine)."""
    return engine_contract(plan) if plan.train.quantization in ("fake_quant", "int4_qat") else None


def covered_linears(model: nn.Module, contract: str | Scheme = "fp8_block") -> list[tuple[str, nn.Linear]]:
    """(module name, module) of every nn.Linear whose `<name>.weight` the contract quantises."""
    covers = contract.covers if isinstance(contract, Scheme) else is_quantized_name
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and covers(f"{name}.weight")
    ]


def covered_expert_stacks(model: nn.Module, scheme: Scheme) -> list[tuple[str, nn.Module]]:
    """(module name, module) of every MoE experts module holding stacked `gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I] parameters (transformers 5), when the scheme covers experts."""
    out = []
    for name, m in model.named_modules():
        if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and isinstance(
            getattr(m, "down_proj", None), nn.Parameter
        ):
            if scheme.covers(f"{name}.0.down_proj.weight"):
                out.append((name, m))
    return out


def _fake_quant_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, self.fake_quant_fn(self.weight), self.bias)


def swapped_forward(forward: Any, swaps: dict[str, Any]) -> Any:
    """A module's bound `forward` that runs with each parameter `name` replaced by `fn(parameter)` for
    its duration only (names, state dict and optimiser keep the real parameter)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        module = forward.__self__
        saved = {name: module._parameters[name] for name in swaps}
        for name, fn in swaps.items():
            module._parameters[name] = fn(saved[name])
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    return run


def install_fake_quant(model: nn.Module, contract: str | Scheme) -> int:
    """Make every covered linear layer of `model` (and, for a packed Scheme, every covered stack of MoE
    experts) compute with the contract's fake-quantised weight.

    Call it before wrapping with FSDP (the module names are then the HF names). Returns how many
    modules were converted; raises when there is none (a model the contract does not cover)."""
    if isinstance(contract, Scheme):
        fn = contract.fmt.fake_quant
        stacks = covered_expert_stacks(model, contract)
    else:
        if contract not in LAYOUTS:
            raise ValueError(f"unknown FP8 layout {contract!r}; known: {', '.join(LAYOUTS)}")
        fn, stacks = (lambda w, layout=contract: fake_quant(w, layout)), []
    layers = covered_linears(model, contract)
    if not layers and not stacks:
        what = contract.name if isinstance(contract, Scheme) else "FP8"
        raise ConfigError(
            f"train.quantization found no layer the {what} contract covers in {type(model).__name__}; "
            "set train.quantization=none (or engine.quant_modules=linear for a dense model)"
        )
    for _, module in layers:
        module.fake_quant_fn = fn
        module.forward = types.MethodType(_fake_quant_forward, module)
    if stacks:
        fmt = contract.fmt  # type: ignore[union-attr]
        swaps = {"gate_up_proj": lambda w: fmt.fake_quant_rows(w, pieces=2), "down_proj": fmt.fake_quant_rows}
        for _, module in stacks:
            module.forward = swapped_forward(module.forward, swaps)
    return len(layers) + len(stacks)


def export_pairs(
    named: Iterable[tuple[str, Tensor]], contract: str | Scheme | None
) -> Iterator[tuple[str, Tensor]]:
    """The export stream in a quantised engine's wire layout: for an FP8 layout each covered `X.weight`
    (given in model.dtype) as the contract's `X.weight` (float8_e4m3fn) and `X.weight_scale_inv`
    (float32); for a packed Scheme as the format's parts; others unchanged. With None the stream passes
    through."""
    if contract is None:
        yield from named
        return
    if isinstance(contract, Scheme):
        for name, tensor in named:
            if contract.covers(name):
                yield from contract.encode(name, tensor)
            else:
                yield name, tensor
        return
    for name, tensor in named:
        if is_quantized_name(name) and tensor.dim() == 2:
            q, scale_inv = quantize_weight(tensor, contract)
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
