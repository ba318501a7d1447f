"""The engine's batch-invariant forward (`--enable-deterministic-inference`): the decoder of
miles/engine/model.py computed with the operations of miles/quant/invariant.py, the ones the FSDP
trainer's forward calls under `train.true_on_policy` (miles/train/fsdp/true_on_policy.py), in
transformers' order and dtypes, so a token's log-prob has the same bits in a decode step, a chunked
prefill, over a cached prefix, and in the trainer's recomputation.

Per layer, as transformers' Qwen2 / Qwen3 / Llama decoder layer computes it:
    h = RMSNorm(x); q, k, v = one projection by the stacked [q; k; v] weights (+ bias), split;
    Qwen3: per-head q / k norms;
    RoPE (transformers' cos / sin, x * cos + rotate_half(x) * sin); the new K/V into the pool;
    each query over its own context (invariant attention); x = x + o_proj(attn)
    x = x + down(silu(gate) * up) with gate, up one projection of RMSNorm(x) by [gate; up]
then RMSNorm and lm_head on each request's last token, logits in fp32. The stacked weights are the
engine's fused qkv_proj / gate_up_proj storage, and the trainer stacks its modules' weights the same
way (`stacked_linear`), so each GEMM has the same shape on both sides.
Qwen3-MoE's sparse layers: the softmax router and top-k of miles/quant/invariant.py `route`, its
experts through `experts`; the chosen ids recorded for routing replay as the other forwards record them.
Not covered (the server refuses them with the flag): shared experts and other routers (DeepSeek),
latent attention, LoRA adapters, low-precision weights.
"""

from __future__ import annotations

import torch

from miles.engine.kv_cache import gather_slots
from miles.engine.packing import to_tokens, token_requests
from miles.engine.spec import Batch
from miles.quant import invariant as inv


class InvariantForward:
    """`forward(batch, pool)` of a Decoder (miles/engine/model.py) through the invariant operations."""

    def __init__(self, decoder) -> None:
        self.d = decoder
        s = decoder.spec
        self.inv_freq = inv.inverse_frequencies(s.head_dim, s.rope_theta, decoder.device)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return inv.rms_norm(x, self.d.params[name], self.d.spec.rms_norm_eps)

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        p = self.d.params
        return inv.linear(x, p[name + ".weight"], p.get(name + ".bias"))

    def _stacked(
        self, x: torch.Tensor, prefix: str, fused: str, members: tuple[str, ...]
    ) -> list[torch.Tensor]:
        """The members' projections of x as one GEMM of their stacked weights (the fused storage where
        the engine keeps one), split back: inv.stacked_linear's layout, the trainer's."""
        d, p = self.d, self.d.params
        weight = d.storage.get(prefix + fused + ".weight")
        if weight is None:
            weight = torch.cat([p[prefix + m + ".weight"] for m in members])
        sizes = [p[prefix + m + ".weight"].shape[0] for m in members]
        bias = d.storage.get(prefix + fused + ".bias")
        if bias is None:
            bias = inv.stacked_bias([p.get(prefix + m + ".bias") for m in members], sizes, weight)
        return inv.stacked_linear(x, weight, bias, sizes)

    def _attention(self, i: int, x: torch.Tensor, b: Batch, cos, sin, pool, req) -> torch.Tensor:
        """One layer's attention; `req` [T] each token's request (Triton kernels; None otherwise)."""
        s, p = self.d.spec, f"model.layers.{i}.self_attn."
        T, D = x.shape[0], s.head_dim
        q, k, v = self._stacked(x, p, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        q, k, v = q.view(T, s.num_heads, D), k.view(T, s.num_kv_heads, D), v.view(T, s.num_kv_heads, D)
        if s.family.qk_norm:
            q, k = self._norm(q, p + "q_norm.weight"), self._norm(k, p + "k_norm.weight")
        q, k = inv.apply_rope(q, cos, sin), inv.apply_rope(k, cos, sin)
        k_pool, v_pool = pool[i]
        k_pool[:, b.write_slots] = k.transpose(0, 1)
        v_pool[:, b.write_slots] = v.transpose(0, 1)
        if req is not None:  # one kernel reads the pool in place
            out = inv.gpu_kernels().paged_attention(
                q, k_pool, v_pool, b.context_slots, req, b.positions, D**-0.5
            )
            return self._proj(out.view(T, -1), p + "o_proj")
        # [B, L, KVH, D] contexts from the pool, [B, Q, H, D] queries
        kc = gather_slots(k_pool, b.context_slots).permute(1, 2, 0, 3)
        vc = gather_slots(v_pool, b.context_slots).permute(1, 2, 0, 3)
        out = inv.attention(q[b.query_index], kc, vc, b.query_pos, D**-0.5)
        return self._proj(to_tokens(out.flatten(0, 1).flatten(1), b, T), p + "o_proj")

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p, m, d = f"model.layers.{i}.mlp.", self.d.spec.moe, self.d
        if m is not None and i in m.sparse_layers:  # Qwen3-MoE: softmax router, routed experts
            _, weights, ids = inv.route(inv.linear(x, d.params[p + "gate.weight"]), m.top_k, m.norm_topk_prob)
            if d.record_routing:
                d._routed.append(ids)
            gate_up = d._stacked(p + "experts.gate_up_proj").view(m.num_experts, 2 * m.intermediate_size, -1)
            down = d._stacked(p + "experts.down_proj").view(m.num_experts, -1, m.intermediate_size)
            return inv.experts(x, ids, weights, gate_up, down)
        gate, up = self._stacked(x, p, "gate_up_proj", ("gate_proj", "up_proj"))
        return self._proj(inv.silu(gate) * up, p + "down_proj")

    @torch.inference_mode()
    def forward(self, b: Batch, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """fp32 logits [B, vocab] at each request's last new token; the new K/V written to the pool."""
        d = self.d
        x = d.params["model.embed_tokens.weight"][b.input_ids]
        req = token_requests(b, x.shape[0]) if inv.kernels_for(x) else None  # once for all layers
        cos, sin = inv.rope_cos_sin(b.positions, self.inv_freq, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D] over the heads
        for i in range(d.spec.num_layers):
            p = f"model.layers.{i}."
            x = x + self._attention(i, self._norm(x, p + "input_layernorm.weight"), b, cos, sin, pool, req)
            x = x + self._mlp(i, self._norm(x, p + "post_attention_layernorm.weight"))
        d._take_routing(b.write_slots)
        h = self._norm(x[b.last_index], "model.norm.weight")
        return inv.linear(h, d.get("lm_head.weight")).float()
