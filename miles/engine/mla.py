"""Multi-head latent attention (DeepSeek-V3's), over a cache of one latent per token.

Maths (one token x, H heads; DeepseekV3Attention is the reference):
    q = W_qb RMSNorm(W_qa x)  (or W_q x without q_lora_rank),  per head [q_n (d_n); q_r (d_r)]
    [c; k_r] = W_kva x,  c <- RMSNorm(c)  (kv_lora_rank r),  k_r: one RoPE key (d_r) shared by every head
    W_kvb = per head [W_uk (d_n x r); W_uv (d_v x r)]
    score(t, s) = (q_n . W_uk c_s + RoPE(q_r) . RoPE(k_r,s)) / sqrt(d_n + d_r)
                = [W_uk^T q_n; RoPE(q_r)] . [c_s; RoPE(k_r,s)] / sqrt(d_n + d_r)
    out_h = W_uv (sum_s softmax(score)_s c_s),  then W_o over the heads' outputs.
So the pool keeps, per layer and token slot, the one vector [c; RoPE(k_r)] of r + d_r values (the
latent cache; SGLang's MLA cache holds the same), and attention is multi-query attention over it:
the queries are absorbed into the latent space (W_uk^T q_n), the values are the keys' first r
values (a view, not a copy), and W_uv applies to the attended latent. RoPE pairs are interleaved
(x_0, x_1), (x_2, x_3), ... when `rope_interleave` (DeepSeek's checkpoints), else rotate_half.
Each layer's query heads fold into the query length of one shared-KV head, as the decoder's
grouped-query attention does, so the decoder's mask and packing serve unchanged.
FP8 engines store the projections as the FP8 contract's pairs (miles/quant/fp8.py); W_kvb, used as
a matrix here, is read dequantised. YaRN rope scaling (DeepSeek-V3's long-context checkpoints):
the decoder's frequencies and cos/sin factor, and the softmax scale times mscale(mscale_all_dim)^2
(miles/engine/rope.py). Left out: the CUDA fused forward and the CPU row decode (this attention takes the decoder's
per-op path on every device), LoRA on these projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles.engine.kv_cache import gather_slots
from miles.engine.packing import to_tokens
from miles.engine.rope import yarn_softmax_scale
from miles.engine.sdpa import masked_sdpa

if TYPE_CHECKING:
    from miles.engine.model import Decoder
    from miles.engine.spec import Batch


@dataclass(frozen=True)
class MlaSpec:
    """The latent attention's shape, from a DeepSeek-V3 config.json."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @classmethod
    def from_config(cls, cfg: dict) -> MlaSpec:
        return cls(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        )

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the cache: the latent and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_names(self, prefix: str) -> list[str]:
        """HF names of one layer's attention tensors (`prefix`: `model.layers.i.`)."""
        p = prefix + "self_attn."
        q = (
            ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
            if self.q_lora_rank
            else ["q_proj.weight"]
        )
        kv = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
        return [p + n for n in q + kv]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of interleaved pairs (x_0, x_1), (x_2, x_3), ...; the result lists every pair's first
    coordinate, then every second one (transformers' layout: dot products are unchanged)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class LatentAttention:
    """The decoder's attention for a model with multi-head latent attention (module docstring)."""

    def __init__(self, decoder: Decoder, spec: MlaSpec):
        self.d, self.m = decoder, spec

    def new_pool(self, num_slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (latent cache [1, num_slots, r + d_r], its first r values as the values' view)."""
        d, r = self.d, self.m.kv_lora_rank
        pools = []
        for _ in range(d.spec.num_layers):
            latent = torch.zeros(1, num_slots, self.m.latent_dim, device=d.device, dtype=d.dtype)
            pools.append((latent, latent[..., :r]))
        return pools

    def _queries(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """[T, H, d_n + d_r] queries of layer i for the normalised input x."""
        d, p = self.d, f"model.layers.{i}.self_attn."
        if self.m.q_lora_rank:
            q = d._norm(d._project(x, p + "q_a_proj.weight"), d.params[p + "q_a_layernorm.weight"])
            q = d._project(q, p + "q_b_proj.weight")
        else:
            q = d._project(x, p + "q_proj.weight")
        return q.view(x.shape[0], d.spec.num_heads, -1)

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return rope_interleaved(x, cos, sin) if self.m.rope_interleave else self.d._rope(x, cos, sin)

    def forward(self, i: int, x: torch.Tensor, b: Batch, cos, sin, pool, mask) -> torch.Tensor:
        """Layer i's attention output [T, hidden] for the normalised input x [T, hidden]; writes the new
        tokens' latents to the pool."""
        d, m, p = self.d, self.m, f"model.layers.{i}.self_attn."
        H, r, dn = d.spec.num_heads, m.kv_lora_rank, m.qk_nope_head_dim
        q_nope, q_rot = self._queries(i, x).split([dn, m.qk_rope_head_dim], dim=-1)
        c, k_rot = d._project(x, p + "kv_a_proj_with_mqa.weight").split([r, m.qk_rope_head_dim], dim=-1)
        c = d._norm(c, d.params[p + "kv_a_layernorm.weight"])
        latent, _ = pool[i]
        latent[0, b.write_slots] = torch.cat((c, self._rope(k_rot[:, None], cos, sin)[:, 0]), dim=-1)
        w = d.get(p + "kv_b_proj.weight").view(H, dn + m.v_head_dim, r)  # FP8 engines: dequantised
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w[:, :dn])
        query = torch.cat((q_lat, self._rope(q_rot, cos, sin)), dim=-1)  # [T, H, r + d_r]
        out = self._attend(query, b, latent, mask)  # [B, Q, H, r]
        out = torch.einsum("bqhr,hvr->bqhv", out, w[:, dn:]).reshape(out.shape[0] * out.shape[1], -1)
        return d._project(to_tokens(out, b, x.shape[0]), p + "o_proj.weight")

    def _attend(self, query: torch.Tensor, b: Batch, latent: torch.Tensor, mask) -> torch.Tensor:
        """Attended latents [B, Q, H, r]: each request's queries (heads folded into the query length)
        over its context's latents gathered from the pool."""
        (B, Q), H, D = b.query_index.shape, query.shape[1], query.shape[2]
        L = b.context_slots.shape[1]
        keys = gather_slots(latent, b.context_slots).view(B, 1, L, D)
        qb = query[b.query_index].permute(0, 2, 1, 3).reshape(B, 1, H * Q, D)
        scale = (self.m.qk_nope_head_dim + self.m.qk_rope_head_dim) ** -0.5
        if self.d.spec.rope_scaling is not None:
            scale = yarn_softmax_scale(self.d.spec.rope_scaling, scale)
        out = masked_sdpa(qb, keys, keys[..., : self.m.kv_lora_rank], mask, scale)
        return out.view(B, H, Q, -1).transpose(1, 2)
