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
that sum: the same values PEFT's x W^T + s (x A^T) B^T computes, in one GEMM per layer plus the weight-
sized product B A.

Built for one tensor- and pipeline-parallel rank and dense layers: with tensor parallelism each rank
would hold a slice of the sum and the adapters' gradients would need a reduction over the TP group,
which is not built (config.train.check_lora refuses it, naming the key). Dropout on the adapter's input
has no place in the weight-sum form (refused too).

The adapter leaves the trainer under PEFT's saved names, `<adapter>/base_model.model.model.layers.<L>.
self_attn.q_proj.lora_A.weight`, as the FSDP backend's does, so the engines, the weight check and the
export read one format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from miles.train.megatron import convert
from miles.train.quant import swapped_forward

MODULES = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("self_attn", ("o_proj",)),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("mlp", ("down_proj",)),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _out_sizes(s: convert.Shapes, hf_cfg: Any) -> dict[str, int]:
    q = s.num_heads * s.head_dim
    kv = s.num_kv_heads * s.head_dim
    inter = hf_cfg.intermediate_size
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hf_cfg.hidden_size,
            "gate_proj": inter, "up_proj": inter, "down_proj": hf_cfg.hidden_size}  # fmt: skip


def _delta(module: nn.Module, suffix: str, projs: list[str], s: convert.Shapes, scale: float) -> Tensor:
    """s B A of every adapted projection of `module`, in the module's weight layout (zeros for a
    projection the run does not adapt)."""
    w = module._parameters["weight"]
    parts = {}
    for proj in MODULES[suffix][1]:
        if proj in projs:
            a, b = getattr(module, f"lora_A_{proj}"), getattr(module, f"lora_B_{proj}")
            parts[proj] = (b @ a) * scale
    if suffix == "self_attention.linear_qkv":
        q, k, v = convert.unpack_qkv(w.detach(), s)
        full = [
            parts.get(p, torch.zeros_like(t))
            for p, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), strict=True)
        ]
        return convert.pack_qkv(*full, s)
    if suffix == "mlp.linear_fc1":
        gate, up = w.detach().chunk(2, dim=0)
        return torch.cat(
            [parts.get("gate_proj", torch.zeros_like(gate)), parts.get("up_proj", torch.zeros_like(up))]
        )
    return parts[MODULES[suffix][1][0]]


def install(gpt: nn.Module, lora: Any, s: convert.Shapes, hf_cfg: Any) -> int:
    """Freeze `gpt` and give every covered layer its adapters (A like PEFT's kaiming-uniform, B zero:
    step 0 is the base model); returns the trainable parameter count."""
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
        for proj in projs:
            in_features = w.shape[1]
            a = torch.empty(lora.rank, in_features, device=w.device, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            b = torch.zeros(outs[proj], lora.rank, device=w.device, dtype=torch.float32)
            module.register_parameter(f"lora_A_{proj}", nn.Parameter(a.to(w.dtype)))
            module.register_parameter(f"lora_B_{proj}", nn.Parameter(b.to(w.dtype)))
            n += a.numel() + b.numel()

        def summed(
            weight: Tensor, module: nn.Module = module, suffix: str = suffix, projs: list = projs
        ) -> Tensor:
            return weight.detach() + _delta(module, suffix, projs, s, scale).to(weight.dtype)

        module.forward = swapped_forward(module.forward, {"weight": summed})
    return n


def adapter_tensors(gpt: nn.Module, name: str, layer_offset: int) -> Iterator[tuple[str, Tensor]]:
    """(`<adapter>/<PEFT saved name>`, tensor in the model's dtype) of every adapter parameter of this
    stage (global layers)."""
    for pname, p in gpt.named_parameters():
        mod, _, leaf = pname.rpartition(".")
        if leaf.startswith(("lora_A_", "lora_B_")):
            yield f"{name}/{peft_name(mod, leaf, layer_offset)}", p.detach()


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
