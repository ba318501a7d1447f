"""The packed weight formats beyond FP8, and which weights a run quantises with them.

A `Scheme` is the contract both sides of a run share for `engine.quantization` int4, mxfp8 or nvfp4:
the format (how one 2-D weight becomes its stored tensors and back) and the weights it covers. The
trainer's fake-quant forward computes with `fmt.fake_quant(W)`, the export ships `fmt.encode(W)`,
the engine stores exactly those tensors and computes with `fmt.decode(...)` of them (or, for int4 on
CUDA, an int4 GEMM over the same codes and scales), so the three hold the same values.

Formats, each replacing `X.weight` [out, in] by the tensors below (X.weight<suffix>):

    int4    _packed int32 [out, in/8], _scale [out, in/g] (model dtype), _shape int64 [2]
            compressed-tensors' pack-quantized W4A16 (miles/quant/int4.py), g = 32 or 128
    mxfp8   (the weight itself) float8_e4m3fn [out, in], _scale uint8 E8M0 [out, in/32]
            (miles/quant/mx.py)
    nvfp4   (the weight itself) uint8 [out, in/2] (two E2M1 codes a byte), _scale float8_e4m3fn
            [out, in/16], _scale_2 fp32 [] (the per-tensor scale g = max(amax, 1e-12) / (6 * 448),
            ModelOpt's naming; miles/quant/mx.py)

Every block runs along the input dimension of one output row, so the formats quantise rows
independently: a stack of weights (fused q/k/v, a tensor-parallel shard of rows) quantises like its
members, except nvfp4's per-tensor scale, which belongs to one Hugging Face tensor.

Covered weights (`modules`): `experts` — the MoE experts' gate/up/down projections (upstream's
default for INT4 QAT); `linear` — those and every dense attention q/k/v/o and MLP gate/up/down
projection. Never embeddings, the LM head, norms, biases or the MoE router. MXFP8 and NVFP4 compute
natively on Blackwell only; Miles emulates them (dequantise, multiply in 16 bits) everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from miles.quant import int4, mx
from miles.quant.contract import PACKED_FORMATS, engine_layout, packed_modules

FORMATS = PACKED_FORMATS
Modules = Literal["experts", "linear"]

_DENSE = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight$"
)
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight$")
NV_TENSOR_FLOOR = 1e-12


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: Tensor, fn: Any) -> Tensor:
        return fn(w.detach())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def straight_through(w: Tensor, fn: Any) -> Tensor:
    """fn(w) computed without autograd, with the identity as its gradient to w."""
    return _StraightThrough.apply(w, fn)


@dataclass(frozen=True)
class Format:
    """One packed format: `encode` a 2-D weight into its parts (suffix -> tensor), `decode` them back."""

    name: str
    group_size: int = 128
    """int4's group (32 or 128); mxfp8's and nvfp4's blocks are fixed (32, 16: set whatever is given)."""

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"unknown weight format {self.name!r}; known: {', '.join(FORMATS)}")
        if self.name == "int4" and self.group_size not in int4.GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {int4.GROUP_SIZES} (got {self.group_size})")
        if self.name != "int4":  # fixed blocks: a format is equal to itself whatever group was asked for
            object.__setattr__(self, "group_size", mx.MX_BLOCK if self.name == "mxfp8" else mx.NV_BLOCK)

    @property
    def block(self) -> int:
        """Input columns per scale."""
        return self.group_size

    @property
    def suffixes(self) -> tuple[str, ...]:
        return {
            "int4": ("weight_packed", "weight_scale", "weight_shape"),
            "mxfp8": ("weight", "weight_scale"),
            "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
        }[self.name]

    @property
    def per_tensor(self) -> bool:
        """Whether a part is shared by the whole tensor (nvfp4's scale_2): stacks quantise per member."""
        return self.name == "nvfp4"

    def check_shape(self, name: str, shape: tuple[int, ...] | torch.Size) -> None:
        if len(shape) != 2 or shape[1] % self.block:
            raise ValueError(
                f"{name}: {self.name} quantises 2-D [out, in] weights whose input dimension is a multiple "
                f"of {self.block}; got {list(shape)} (leave it unquantised: engine.quant_modules=experts, "
                f"or another format)"
            )

    def encode(self, w: Tensor, scale_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The stored parts of a 2-D weight (int4's scale in `scale_dtype`, default w's dtype)."""
        self.check_shape("weight", w.shape)
        if self.name == "int4":
            q, s = int4.quantize(w, self.group_size, scale_dtype)
            shape = torch.tensor(list(w.shape), dtype=torch.int64, device=w.device)
            return {
                "weight_packed": int4.pack(q),
                "weight_scale": s.to(scale_dtype or w.dtype),
                "weight_shape": shape,
            }
        if self.name == "mxfp8":
            scales, q = mx.mxfp8_quantize(w)
            return {"weight": q, "weight_scale": scales}
        g = (
            w.detach().float().abs().amax().clamp(min=NV_TENSOR_FLOOR) / (mx.E2M1_MAX * mx.E4M3_MAX)
        ).reshape(())
        scales, packed = mx.nvfp4_quantize(w, g)
        return {"weight": packed, "weight_scale": scales, "weight_scale_2": g}

    def decode(self, parts: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
        """The weight the parts stand for, in `dtype` (every op in fp32, rounded once)."""
        if self.name == "int4":
            shape = tuple(int(x) for x in parts["weight_shape"].tolist())
            q = int4.unpack(parts["weight_packed"], shape)
            return int4.dequantize(q, parts["weight_scale"], self.group_size, dtype)
        if self.name == "mxfp8":
            return mx.mxfp8_dequantize(parts["weight_scale"], parts["weight"], dtype)
        return mx.nvfp4_dequantize(parts["weight_scale"], parts["weight"], parts["weight_scale_2"], dtype)

    def quant_dequant(self, w: Tensor) -> Tensor:
        """decode(encode(w)) in w's dtype, without autograd."""
        return self.decode(self.encode(w), w.dtype)

    def fake_quant(self, w: Tensor) -> Tensor:
        """The stored weight's value in w's dtype, with the identity as its gradient (straight-through)."""
        return straight_through(w, self.quant_dequant)

    def fake_quant_rows(self, w: Tensor, pieces: int = 1) -> Tensor:
        """fake_quant of a stack whose last dimension is the input one: `w` [..., rows, in] made of
        `pieces` Hugging Face tensors along the rows of each leading index (fused gate/up: 2)."""
        lead, rows, cols = w.shape[:-2], w.shape[-2], w.shape[-1]
        if not self.per_tensor:
            return self.fake_quant(w.reshape(-1, cols)).reshape(w.shape)
        flat = w.reshape(-1, rows // pieces, cols)
        out = torch.stack([self.fake_quant(t) for t in flat.unbind(0)])
        return out.reshape(*lead, rows, cols)

    def part_dtypes(self, model_dtype: torch.dtype) -> dict[str, torch.dtype]:
        return {
            "int4": {"weight_packed": torch.int32, "weight_scale": model_dtype, "weight_shape": torch.int64},
            "mxfp8": {"weight": torch.float8_e4m3fn, "weight_scale": torch.uint8},
            "nvfp4": {
                "weight": torch.uint8,
                "weight_scale": torch.float8_e4m3fn,
                "weight_scale_2": torch.float32,
            },
        }[self.name]

    def check_parts(self, base: str, parts: dict[str, Tensor], model_dtype: torch.dtype) -> None:
        """ValueError naming the tensor when `parts` (of HF weight `base`.weight) are not this format's."""
        missing = [s for s in self.suffixes if s not in parts]
        if missing:
            raise ValueError(
                f"{base}: a {self.name} weight travels as {', '.join(f'{base}.{s}' for s in self.suffixes)}; "
                f"{', '.join(f'{base}.{s}' for s in missing)} did not come"
            )
        for suffix, want in self.part_dtypes(model_dtype).items():
            got = parts[suffix].dtype
            if got != want:
                raise ValueError(
                    f"{base}.{suffix} must be {str(want).removeprefix('torch.')} for {self.name}, "
                    f"got {str(got).removeprefix('torch.')}"
                )

    def quantization_config(self, modules: Modules) -> dict[str, Any]:
        """config.json's `quantization_config` of a checkpoint in this format."""
        targets = _EXPERT_TARGET if modules == "experts" else ["Linear"]
        if self.name == "int4":
            return int4.quantization_config(
                self.group_size, targets=targets, ignore=["lm_head", "re:.*mlp.gate$"]
            )
        return {
            "quant_method": "miles",
            "format": self.name,
            "block_size": self.block,
            "modules": modules,
            "ignore": ["lm_head", "re:.*mlp.gate$"],
        }


_EXPERT_TARGET = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]


@dataclass(frozen=True)
class Scheme:
    """A format and the weights it covers: the contract of one run (module docstring)."""

    fmt: Format
    modules: Modules = "linear"

    @property
    def name(self) -> str:
        return self.fmt.name

    def covers(self, hf_name: str) -> bool:
        if _EXPERT.match(hf_name):
            return True
        return self.modules == "linear" and _DENSE.match(hf_name) is not None

    def encode(self, name: str, w: Tensor) -> list[tuple[str, Tensor]]:
        """The wire tensors of covered HF weight `name` (X.weight -> X.weight<suffix>...)."""
        self.fmt.check_shape(name, w.shape)
        base = name.removesuffix(".weight")
        return [(f"{base}.{suffix}", t) for suffix, t in self.fmt.encode(w).items()]

    def part_names(self, name: str) -> list[str]:
        base = name.removesuffix(".weight")
        return [f"{base}.{suffix}" for suffix in self.fmt.suffixes]

    def base_of(self, part: str) -> str | None:
        """ "X.weight" for a part name "X.<suffix>" of a covered weight; None for anything else."""
        for suffix in self.fmt.suffixes:
            if part.endswith("." + suffix):
                name = part[: -len(suffix)] + "weight"
                if self.covers(name):
                    return name
        return None

    def quantization_config(self) -> dict[str, Any]:
        return self.fmt.quantization_config(self.modules)


def scheme_from_config(qc: dict[str, Any] | None) -> Scheme | None:
    """The Scheme a checkpoint's `quantization_config` describes; None for FP8 or none.
    ValueError naming the key for a packed format the engine cannot load."""
    if not qc or qc.get("quant_method") == "fp8":
        return None
    if qc.get("quant_method") == "miles":
        return Scheme(Format(qc["format"]), qc.get("modules", "linear"))
    if qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "pack-quantized":
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(
                "quantization_config: the engine loads pack-quantized checkpoints of one config group"
            )
        w = groups[0].get("weights") or {}
        if (w.get("num_bits"), w.get("symmetric"), w.get("strategy")) != (4, True, "group"):
            raise ValueError(
                "quantization_config: the engine's int4 is 4-bit symmetric per-group weights "
                f"(got num_bits={w.get('num_bits')}, symmetric={w.get('symmetric')}, strategy={w.get('strategy')})"
            )
        targets = groups[0].get("targets") or []
        modules: Modules = "experts" if targets == _EXPERT_TARGET else "linear"
        return Scheme(Format("int4", int(w.get("group_size") or 128)), modules)
    raise ValueError(
        f"quantization_config.quant_method {qc.get('quant_method')!r} (format {qc.get('format')!r}) is not "
        "one the embedded engine loads: fp8, compressed-tensors pack-quantized (int4), or miles (mxfp8, nvfp4)"
    )


def engine_scheme(plan: Any) -> Scheme | None:
    """The packed Scheme of the run's `engine.quantization` (int4, mxfp8, nvfp4; what it covers:
    miles.quant.contract.packed_modules), or None."""
    modules = packed_modules(plan)
    if modules is None:
        return None
    return Scheme(Format(plan.engine.quantization, plan.engine.int4_group_size), modules)


def engine_contract(plan: Any) -> str | Scheme | None:
    """The weight contract of the run's engines: an FP8 layout, a packed Scheme, or None (bf16)."""
    return engine_layout(plan) or engine_scheme(plan)
