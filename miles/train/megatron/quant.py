"""The quantisation contract's fake-quant forward for Megatron's linear layers (`train.quantization` =
fake_quant or int4_qat): an FP8 layout (miles/quant/fp8.py) covers the dense layers; a packed Scheme
(miles/quant/formats.py: int4, mxfp8, nvfp4) covers the experts' fc1 / fc2 and, with modules=linear,
the dense layers too. What follows is written for FP8 and holds for each.

The contract quantises Hugging Face tensors (q/k/v/o, gate/up/down, 128x128 blocks or rows of each),
while Megatron fuses q/k/v into one group-interleaved `linear_qkv` and gate/up into `linear_fc1`, and
splits every weight over tensor-parallel ranks. So each covered layer's forward computes its weight as:

    full  = tensor-parallel all-gather of the local weight (convert.tp_unshard)
    HF    = the HF tensors of `full` (convert.unpack_qkv, gate/up halves)
    HF'   = dequantize_weight(*quantize_weight(t, layout), layout, t.dtype) for each HF tensor t
    local = this rank's slice of the Megatron tensor packed back from HF' (convert.tp_shard)

which are exactly the values the FP8 engine holds after `export_weights` shipped the contract's pairs
of the same model.dtype tensors. The gradient is the identity (straight-through) to the local
weight, so Megatron's DDP and distributed optimizer see an ordinary parameter. The weight is
swapped in only for the duration of the module's forward; parameter names, the state dict and
checkpoints are unchanged. Costs one all-gather of each covered weight per forward when
tensor_parallel > 1 (none otherwise).

Validated against megatron-core's local layer spec (ColumnParallelLinear / RowParallelLinear read
`self.weight` in forward, with gradient_accumulation_fusion off, as miles/train/megatron/model.py
configures it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from miles.quant.formats import Scheme, straight_through
from miles.quant.fp8 import fake_quant
from miles.train.megatron import convert
from miles.train.quant import swapped_forward

_COVERED = re.compile(
    r"^decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|mlp\.linear_fc1|"
    r"mlp\.linear_fc2|mlp\.experts\.local_experts\.\d+\.linear_fc[12])$"
)
QuantFn = Callable[[Tensor], Tensor]
"""The contract's quantise -> dequantise of one Hugging Face weight."""


def contract_fn(contract: str | Scheme) -> QuantFn:
    """The per-HF-tensor fake quantiser of an FP8 layout or a packed Scheme."""
    if isinstance(contract, Scheme):
        return contract.fmt.quant_dequant
    return lambda w: fake_quant(w, contract)


def fake_quant_full(suffix: str, full: Tensor, contract: str | Scheme | QuantFn, s: convert.Shapes) -> Tensor:
    """A full (TP-unsharded) Megatron weight whose HF pieces are replaced by their contract values
    (an expert's fc1 / fc2 reads as the dense MLP's: convert._suffix)."""
    fn = contract if callable(contract) else contract_fn(contract)
    if suffix == "self_attention.linear_qkv.weight":
        q, k, v = (fn(p) for p in convert.unpack_qkv(full, s))
        return convert.pack_qkv(q, k, v, s)
    if suffix == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([fn(gate), fn(up)], dim=0)
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return fn(full)
    raise KeyError(f"{suffix!r} is not a Megatron weight the contract covers")


def fake_quant_local(
    name: str,
    local: Tensor,
    contract: str | Scheme | QuantFn,
    s: convert.Shapes,
    tp_rank: int,
    tp_size: int,
    group: Any = None,
) -> Tensor:
    """This TP rank's slice of the fake-quantised weight `name` (global Megatron name), from its own
    slice `local`; with tp_size > 1 an all-gather over `group` (collective of the TP group)."""
    if tp_size == 1:
        full = local
    else:
        shards = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(shards, local.contiguous(), group=group)
        full = convert.tp_unshard(name, shards, s)
    out = fake_quant_full(convert._suffix(name), full, contract, s)
    return convert.tp_shard(name, out, tp_rank, tp_size, s).contiguous()


def covered_modules(
    gpt: nn.Module, layer_offset: int, contract: str | Scheme = "fp8_block"
) -> list[tuple[str, nn.Module]]:
    """(global Megatron weight name, module) of every linear layer of this stage the contract covers:
    an FP8 layout the dense ones, a packed Scheme the experts and, with modules=linear, the dense ones."""
    experts_only = isinstance(contract, Scheme) and contract.modules == "experts"
    out = []
    for name, module in gpt.named_modules():
        m = _COVERED.match(name)
        if m is None or not isinstance(getattr(module, "weight", None), Tensor):
            continue
        expert = ".local_experts." in name
        if expert and not isinstance(contract, Scheme):
            continue  # the FP8 contract leaves experts in model.dtype
        if experts_only and not expert:
            continue
        out.append((convert.to_global(f"{name}.weight", layer_offset), module))
    return out


def install_fake_quant(
    gpt: nn.Module,
    contract: str | Scheme,
    s: convert.Shapes,
    layer_offset: int,
    tp_rank: int,
    tp_size: int,
    group: Any,
) -> int:
    """Make every covered linear layer of this stage forward with its fake-quantised weight; returns
    how many were converted."""
    from miles.config import ConfigError

    modules = covered_modules(gpt, layer_offset, contract)
    if not modules:
        raise ConfigError(
            "train.quantization found no Megatron linear layer the contract covers "
            "(linear_qkv, linear_proj, linear_fc1, linear_fc2, experts); set train.quantization=none "
            "(or engine.quant_modules=linear for a dense model)"
        )
    fn = contract_fn(contract)
    for name, module in modules:

        def quantised(w: Tensor, name: str = name) -> Tensor:
            return fake_quant_local(name, w, fn, s, tp_rank, tp_size, group)

        module.forward = swapped_forward(
            module.forward, {"weight": lambda w, q=quantised: straight_through(w, q)}
        )
    return len(modules)
