"""The decoder's CUDA forward (`Decoder.forward` on CUDA tensors, `fused` set): a layer in about ten
kernels, with the roundings of the per-op path of miles/engine/model.py.

What it fuses (miles/engine/triton_fused.py):
- the fp32 residual add with the next RMSNorm;
- q/k/v in one GEMM and gate/up in one GEMM (their weights are stored fused);
- RoPE with the K/V pool write;
- silu(gate) * up.

With LoRA adapters whose A is stacked under the weights (miles/engine/lora.py), each layer's GEMM
yields [x W^T | x A^T], and the kernel that reads the output next adds the adapters' term
(miles/engine/triton_lora.py): the RoPE and K/V-store kernel for q/k/v, the activation's for gate/up,
and the add-and-norm's for o and down. No adapters' kernel runs on its own.

`FusedForward` is the forward strategy a CUDA `Decoder` holds (`Decoder.fused_forward`). It reads
the decoder's weights (`params`, `storage`, `wide`), its adapter bank (`lora`) and the per-op pieces
it shares with the CPU forward (`_project`, `_attend`, `_mlp`, `_logits`, `_decode_mask`,
`_take_routing`, `_has_fused`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from miles.engine.spec import Batch

if TYPE_CHECKING:
    from miles.engine.model import Decoder


class FusedForward:
    """The CUDA forward of a `Decoder` (miles/engine/model.py; module docstring)."""

    def __init__(self, decoder: Decoder) -> None:
        self.d = decoder

    def forward(self, b: Batch, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`forward` on CUDA in ~10 kernels a layer: the fp32 residual add fused with the next norm,
        one GEMM for q/k/v and one for gate/up, RoPE fused with the K/V pool write, silu(gate) * up in
        one kernel (miles/engine/triton_fused.py; the same roundings as the per-op path)."""
        from miles.engine.triton_fused import add_rms_norm_, rope_store_kv

        d = self.d
        w, st, eps = d.params, d.storage, d.spec.rms_norm_eps
        x = d.embed(b).float()
        freqs = b.positions.float()[:, None] * d.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # the per-op path's [cos | cos] halves, once
        mask = d._decode_mask(b)
        layers = [f"model.layers.{i}." for i in range(d.spec.num_layers)]
        after = [p + "input_layernorm.weight" for p in layers[1:]] + ["model.norm.weight"]
        h = add_rms_norm_(x, None, w[layers[0] + "input_layernorm.weight"], eps, d.dtype)
        for i, (p, next_norm) in enumerate(zip(layers, after, strict=True)):
            qkv, lora = self._qkv_parts(h, p + "self_attn.qkv_proj", st.get(p + "self_attn.qkv_proj.bias"))
            q_norm, k_norm = w.get(p + "self_attn.q_norm.weight"), w.get(p + "self_attn.k_norm.weight")
            q = rope_store_kv(
                qkv, cos, sin, *pool[i], b.write_slots, d.spec.num_heads, q_norm, k_norm, eps, lora
            )
            attended = d._attend(q, b, pool[i], mask)
            h = self._project_add_norm(
                attended, p + "self_attn.o_proj.weight", x, w[p + "post_attention_layernorm.weight"]
            )
            if d._has_fused(p + "mlp.gate_up_proj.weight"):
                act = self._gate_up_act(h, p + "mlp.gate_up_proj.weight")
                h = self._project_add_norm(act, p + "mlp.down_proj.weight", x, w[next_norm])
            else:  # a sparse (MoE) layer, or FP8 gate/up kept unfused (miles/engine/fp8_weights.py)
                h = add_rms_norm_(x, d._mlp(i, h), w[next_norm], eps, d.dtype)
        d._take_routing(b.write_slots)
        if d.capture_hidden:
            d.hidden = h
        # decode (one query per request) packs exactly the last tokens, in order; the norm is per row
        decode = b.query_index.shape[1] == 1
        return d._logits(h if decode else h[b.last_index], None if decode else b.last_index)

    def _qkv_parts(
        self, x: torch.Tensor, module: str, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """(q/k/v projection, None) for the RoPE and K/V-store kernel (CUDA forward); with the LoRA
        group's A stacked under the weight, (the base projection, the adapters' part), which that kernel
        adds."""
        d = self.d
        if d.lora is not None and d.lora.terms.fuses_next(module, "rope"):
            wide_bias = None if bias is None else d.wide[module + ".bias"]
            return d.lora.terms.rope_parts(F.linear(x, d.wide[module + ".weight"], wide_bias), module)
        return d._project(x, module + ".weight", bias), None

    def _project_add_norm(
        self, inp: torch.Tensor, name: str, x: torch.Tensor, norm: torch.Tensor
    ) -> torch.Tensor:
        """x += `_project(inp, name)` in place (the fp32 residual stream) and the rows normed by `norm`
        (CUDA forward)."""
        from miles.engine.triton_fused import add_rms_norm_

        d = self.d
        return add_rms_norm_(x, d._project(inp, name), norm, d.spec.rms_norm_eps, d.dtype)

    def _gate_up_act(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up weight `name` (CUDA forward); with the LoRA group's A
        stacked under it, one kernel finishes the GEMM and applies the activation."""
        from miles.engine.triton_fused import silu_mul

        d = self.d
        module = name.removesuffix(".weight")
        if d.lora is not None and d.lora.terms.fuses_next(module, "silu"):
            return d.lora.terms.split_silu(F.linear(x, d.wide[name]), module)
        return silu_mul(d._project(x, name))
