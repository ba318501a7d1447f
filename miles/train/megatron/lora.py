"""LoRA training in the Megatron backend (train.lora with train.backend=megatron).

Each covered layer of the decoder gets the adapters of the Hugging Face projections it fuses, as
parameters of its own module (so Megatron's DDP and distributed optimiser hold them, and only them:
the base weights are frozen):

    linear_qkv   q_proj, k_proj, v_proj     lora_A_<proj> [r, in], lora_B_<proj> [out, r]
    linear_proj  o_proj
    linear_fc1   gate_proj, up_proj
    linear_fc2   down_proj

A covered layer forwards with the weight W + s B A (s = alpha / r): each projection's s B A is
computed in Hugging Face layout and packed into the module's layout (q/k/v group-interleaved as
convert.pack_qkv, gate over up), then swapped in for the duration of the forward (the parameter names,
state dict and checkpoints keep the frozen W and the adapters). The gradient reaches A and B through
that sum: the same values PEFT's x W^T + s (x A^T) B^T computes, in one GEMM per layer plus the
product B A.

Tensor parallelism: every rank holds the whole adapters (their full Hugging Face shapes) and computes
only its slice of s B A, the slice of W it holds: rows of B for a column-parallel layer (q/k/v by
whole key/value groups, gate and up by halves, as convert.tp_shard splits W), columns of A for a
row-parallel one. Each rank's gradient of A and B is then the part its slice contributes; A and B enter
the forward through Megatron's `copy_to_tensor_model_parallel_region`, whose backward all-reduces over
the tensor-parallel group, so every rank ends with the full gradient and the same update (Megatron
counts such duplicated parameters once in the gradient norm). Pipeline parallelism needs nothing of
its own: each stage holds its layers' adapters, and the push and the export gather them over the
stages (weights.iter_megatron_full). A is initialised from a generator seeded by the run's seed, the
global layer and the projection, so every layout starts from the same adapter.

Dense layers only (expert parallelism, and experts' layers, get no adapter; config.train.check_lora
refuses train.expert_parallel > 1). Dropout on the adapter's input has no place in the weight-sum form
(refused too).

The adapter leaves the trainer under PEFT's saved names, `<adapter>/base_model.model.model.layers.<L>.
self_attn.q_proj.lora_A.weight`, as the FSDP backend's does, so the engines, the weight check and the
export read one format.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from miles.lora.adapters import wire_name
from miles.train.megatron import convert
from miles.train.quant import swapped_forward

MODULES = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("self_attn", ("o_proj",)),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("mlp", ("down_proj",)),
}
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")
"""Layers whose weight tensor parallelism splits by input columns (the others by output rows)."""
_PROJS = tuple(p for _, projs in MODULES.values() for p in projs)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class Split:
    """This rank's place in the tensor-parallel group, and the shapes of the slice it holds."""

    rank: int
    size: int
    local: convert.Shapes
    """Shapes of this rank's slice: its share of the attention and key/value heads."""

    @classmethod
    def of(cls, s: convert.Shapes, rank: int, size: int) -> Split:
        local = dataclasses.replace(s, num_heads=s.num_heads // size, num_kv_heads=s.num_kv_heads // size)
        return cls(rank, size, local)


def _out_sizes(s: convert.Shapes, hf_cfg: Any) -> dict[str, int]:
    q = s.num_heads * s.head_dim
    kv = s.num_kv_heads * s.head_dim
    inter = hf_cfg.intermediate_size
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hf_cfg.hidden_size,
            "gate_proj": inter, "up_proj": inter, "down_proj": hf_cfg.hidden_size}  # fmt: skip


def _to_tp_region(t: Tensor, split: Split) -> Tensor:
    """`t` unchanged; in the backward its gradient is summed over the tensor-parallel group."""
    if split.size == 1:
        return t
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(t)


def _delta(module: nn.Module, suffix: str, projs: list[str], split: Split, scale: float) -> Tensor:
    """s B A of every adapted projection of `module`, this rank's slice in the module's weight layout
    (zeros for a projection the run does not adapt)."""
    w = module._parameters["weight"]
    parts = {}
    for proj in MODULES[suffix][1]:
        if proj in projs:
            a = _to_tp_region(getattr(module, f"lora_A_{proj}"), split)
            b = _to_tp_region(getattr(module, f"lora_B_{proj}"), split)
            # HF's q rows are grouped by key/value head and in order, so whole groups are whole row blocks
            if suffix in ROW_PARALLEL:
                a = a.chunk(split.size, dim=1)[split.rank]
            else:
                b = b.chunk(split.size, dim=0)[split.rank]
            parts[proj] = (b @ a) * scale
    if suffix == "self_attention.linear_qkv":
        q, k, v = convert.unpack_qkv(w.detach(), split.local)
        full = [
            parts.get(p, torch.zeros_like(t))
            for p, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), strict=True)
        ]
        return convert.pack_qkv(*full, split.local)
    if suffix == "mlp.linear_fc1":
        gate, up = w.detach().chunk(2, dim=0)
        return torch.cat(
            [parts.get("gate_proj", torch.zeros_like(gate)), parts.get("up_proj", torch.zeros_like(up))]
        )
    return parts[MODULES[suffix][1][0]]


def _initial_a(rank: int, in_features: int, seed: int, layer: int, proj: str) -> Tensor:
    """PEFT's A initialisation (kaiming-uniform, a = sqrt(5)) from a generator of its own, so that the
    tensor-parallel ranks, and any other layout, draw the same adapter."""
    index = _PROJS.index(proj)
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer * len(_PROJS) + index) % (1 << 63))
    a = torch.empty(rank, in_features)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


def install(gpt: nn.Module, lora: Any, hf_cfg: Any, seed: int) -> int:
    """Freeze `gpt`, this rank's stage and tensor-parallel slice, and give every covered layer its
    adapters (A like PEFT's kaiming-uniform, B zero: step 0 is the base model); returns the trainable
    parameter count of this rank."""
    from megatron.core import parallel_state as ps

    from miles.train.megatron import model as M

    s, layer_offset = M.shapes_of(hf_cfg), M.layer_offset(gpt)
    split = Split.of(s, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    gpt.requires_grad_(False)
    outs, scale, n = _out_sizes(s, hf_cfg), lora.alpha / lora.rank, 0
    targets = set(lora.target_modules)
    for name, module in gpt.named_modules():
        m = _LAYER.match(name)
        if m is None or m.group(2) not in MODULES:
            continue
        suffix = m.group(2)
        projs = [p for p in MODULES[suffix][1] if p in targets]
        if not projs:
            continue
        w = module.weight
        in_features = w.shape[1] * (split.size if suffix in ROW_PARALLEL else 1)
        for proj in projs:
            a = _initial_a(lora.rank, in_features, seed, int(m.group(1)) + layer_offset, proj)
            b = torch.zeros(outs[proj], lora.rank)
            module.register_parameter(f"lora_A_{proj}", nn.Parameter(a.to(w.device, w.dtype)))
            module.register_parameter(f"lora_B_{proj}", nn.Parameter(b.to(w.device, w.dtype)))
            n += a.numel() + b.numel()

        def summed(
            weight: Tensor, module: nn.Module = module, suffix: str = suffix, projs: list = projs
        ) -> Tensor:
            return weight.detach() + _delta(module, suffix, projs, split, scale).to(weight.dtype)

        module.forward = swapped_forward(module.forward, {"weight": summed})
    return n


def is_adapter(name: str) -> bool:
    """Whether Megatron parameter `name` is a LoRA adapter's."""
    return name.rpartition(".")[2].startswith(("lora_A_", "lora_B_"))


def adapter_tensors(gpt: nn.Module, name: str, s: convert.Shapes) -> Iterator[tuple[str, Tensor]]:
    """(`<adapter>/<PEFT saved name>`, tensor in the model's dtype) of every adapter parameter, every
    pipeline stage's, on every rank. Collective over the pipeline stages: every rank iterates to the end."""
    from miles.train.megatron import weights

    for mname, t in weights.iter_megatron_full(gpt, s, keep=is_adapter):
        mod, _, leaf = mname.rpartition(".")
        yield wire_name(name, peft_name(mod, leaf, 0)), t


def peft_name(module: str, leaf: str, layer_offset: int) -> str:
    """PEFT's saved name of adapter parameter `leaf` (lora_A_q_proj) of Megatron module `module`
    (decoder.layers.<local>.self_attention.linear_qkv, possibly behind a wrapper's prefix)."""
    m = _LAYER.match(module[module.index("decoder.") :])
    if m is None:
        raise KeyError(f"{module}.{leaf} is not a LoRA parameter of a decoder layer")
    layer = int(m.group(1)) + layer_offset
    kind, proj = leaf[len("lora_") : len("lora_") + 1], leaf[len("lora_A_") :]
    sub = MODULES[m.group(2)][0]
    return f"base_model.model.model.layers.{layer}.{sub}.{proj}.lora_{kind}.weight"
