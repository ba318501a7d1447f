"""DeepSeek-V4's attention in the engine: a sliding window plus compressed entries, over per-token caches.

Maths (one query token at position t of a layer; DeepseekV4Attention is the reference):
    q_res = RMSNorm(W_qa x),  q = RoPE(RMS(W_qb q_res))  per head (RMS: unweighted, per head)
    kv    = RoPE(RMSNorm(W_kv x))   one shared head: it is both key and value
    keys  = kv at positions t-window+1..t,  plus compressed entries (below)
    out_h = softmax over [q.keys / sqrt(d); sink_h] (the sink takes probability, brings no value) . keys
    out   = W_ob(grouped W_oa(RoPE^-1(out)))   (RoPE undone on the value's rope slice at t)
RoPE here is DeepSeek's interleaved pairs on the trailing `rope_dim` channels, in place (the layout of
transformers' V4, which keeps it, since values carry it too); sliding layers use the `main` theta,
compressed layers the `compress` one.

Compressed entries, rate m (`compressed_sparse_attention`: m=4, `heavily_compressed_attention`: 128):
    every token writes C = W_ckv x and Z = W_cgate x + B[pos mod m] (B: the position bias);
    entry w = RMSNorm(sum_j softmax_j(Z_j) * C_j) over window w's m tokens (per channel), RoPE at w*m;
    CSA overlaps windows: its C, Z have two halves [a; b], entry w pools half a of window w-1 with
    half b of window w (2m slots; before position 0 the slots weigh nothing).
Query t sees entry w once its window has closed, (w+1)*m <= t+1. HCA attends every entry it sees; CSA
attends the `index_topk` of them that the Lightning Indexer scores highest:
    score(t, w) = sum_h relu(q^I_h . K^I_w) / sqrt(d_I) * (W_w x)_h / sqrt(H_I),
with q^I = RoPE(W^I_qb q_res) and K^I the entries of the indexer's own compressor (overlapping, at
`index_head_dim`).

Caches (`LayerCache`, per layer, by pool slot like the K/V of other attentions, so prefix reuse,
chunked prefill and continuous batching serve them unchanged): the window's `kv`; for compressed layers
each token's C and Z and the entry its window yields, kept at the slot of the window's last token (the
entry is a function of the prefix up to that token alone); for CSA the indexer's C, Z and entries too.
Every new token writes a candidate entry; attention reads only the slots of closed windows, so a
forward has no data-dependent shapes or host synchronisation (a decode step is captured whole in a
CUDA graph). Left out: YaRN rope scaling (the real checkpoints' `compress` rope: refused by the spec).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from miles.engine.packing import to_tokens, token_requests
from miles.engine.v4_spec import CSA, SLIDING

if TYPE_CHECKING:
    from miles.engine.deepseek_v4 import V4Decoder
    from miles.engine.spec import Batch
    from miles.engine.v4_spec import V4Spec


@dataclass
class LayerCache:
    """One layer's caches, [slots, ...] each (module docstring); compressed layers only have the rest."""

    kv: torch.Tensor
    comp: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """"compressor" (and CSA's "indexer") -> (C [slots, W*D], Z [slots, W*D] fp32, entry [slots, D])."""


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of x [T, heads, d]'s trailing 2 * cos.shape[-1] channels, in place of layout;
    cos, sin [T, pairs] in x's dtype, the rotation in fp32 (transformers' V4 order of rounding)."""
    rd = 2 * cos.shape[-1]
    c, s = cos[:, None].float(), sin[:, None].float()
    r = x[..., -rd:]
    x1, x2 = r[..., 0::2].float(), r[..., 1::2].float()
    rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], rot), dim=-1)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _window(pool: torch.Tensor, b: Batch, owner: torch.Tensor, width: int, T: int):
    """(keys [T, width, D], additive bias [T, width]) of each token's window, itself included."""
    pos = b.positions[:, None] - torch.arange(width - 1, -1, -1, device=b.positions.device)
    keys = pool[b.context_slots[owner[:, None], pos.clamp(min=0)]]
    bias = torch.zeros(pos.shape, dtype=torch.float32, device=pos.device).masked_fill_(pos < 0, float("-inf"))
    return keys, bias


def _entries(pool: torch.Tensor, b: Batch, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(entries [B, C, D] of each request's windows, visible [B, Q, C]): entry w sits at the slot of
    position (w+1)*rate - 1 and a query sees it once that position is reached."""
    count = b.context_slots.shape[1] // rate
    ends = torch.arange(count, device=b.context_slots.device) * rate + (rate - 1)
    entries = pool[b.context_slots[:, ends]]
    return entries, ends[None, None, :] <= b.query_pos[:, :, None]


class HybridAttention:
    """The decoder's attention for DeepSeek-V4 (module docstring): `forward` runs one layer."""

    def __init__(self, decoder: V4Decoder, spec: V4Spec):
        self.d, self.m = decoder, spec

    def new_pool(self, num_slots: int) -> list[LayerCache]:
        """Per layer, the caches of `num_slots` token slots (zeros: masked slots are still read)."""
        d, m = self.d, self.m

        def mk(width: int, dtype=None) -> torch.Tensor:
            return torch.zeros(num_slots, width, device=d.device, dtype=dtype or d.dtype)

        pools = []
        for kind in m.layer_types:
            cache = LayerCache(mk(m.head_dim))
            if kind != SLIDING:
                w = (2 if kind == CSA else 1) * m.head_dim
                cache.comp["compressor"] = (mk(w), mk(w, torch.float32), mk(m.head_dim))
            if kind == CSA:
                di = m.index_head_dim
                cache.comp["indexer"] = (mk(2 * di), mk(2 * di, torch.float32), mk(di))
            pools.append(cache)
        return pools

    def forward(self, i: int, x: torch.Tensor, b: Batch, cache: LayerCache) -> torch.Tensor:
        """Layer i's attention output [T, hidden] for the normalised input x; writes the new tokens'
        caches."""
        d, m, p = self.d, self.m, f"model.layers.{i}.self_attn."
        kind = m.layer_types[i]
        cos, sin = d.rope_at(b.positions, "main" if kind == SLIDING else "compress")
        T, H, D = x.shape[0], m.num_heads, m.head_dim
        q_res = d.v4_norm(d._project(x, p + "q_a_proj.weight"), p + "q_a_norm.weight")
        q = unweighted_rms(d._project(q_res, p + "q_b_proj.weight").view(T, H, D), m.eps)
        q = rope_tail(q, cos, sin)
        kv = d.v4_norm(d._project(x, p + "kv_proj.weight"), p + "kv_norm.weight")
        cache.kv[b.write_slots] = rope_tail(kv[:, None], cos, sin)[:, 0]
        owner = token_requests(b, T)
        keys, bias = _window(cache.kv, b, owner, m.sliding_window, T)
        ckeys = cbias = None
        if kind != SLIDING:
            rate = m.compress_rates[kind]
            self._compress(x, b, owner, p + "compressor.", cache.comp["compressor"], rate, kind == CSA)
            ckeys, visible = _entries(cache.comp["compressor"][2], b, rate)
            if kind == CSA:
                visible = self._indexed(i, x, q_res, b, owner, cache, visible)
            cbias = torch.zeros(visible.shape, dtype=torch.float32, device=x.device)
            cbias.masked_fill_(~visible, float("-inf"))
        out = rope_tail(self._attend(q, keys, bias, ckeys, cbias, b, d.params[p + "sinks"]), cos, -sin)
        grouped = out.reshape(T, m.o_groups, -1)
        w = d.get(p + "o_a_proj.weight").view(m.o_groups, -1, grouped.shape[-1])
        mixed = torch.einsum("tgi,gri->tgr", grouped, w).reshape(T, -1)
        return d._project(mixed, p + "o_b_proj.weight")

    def _compress(self, x, b: Batch, owner, p: str, caches, rate: int, overlap: bool) -> None:
        """Write the new tokens' C and Z, and the entry of the window each new token would close."""
        d = self.d
        c_pool, z_pool, e_pool = caches
        bias = d.params[p + "position_bias"].float()
        c_pool[b.write_slots] = d._project(x, p + "kv_proj.weight")
        z_pool[b.write_slots] = d._project(x, p + "gate_proj.weight").float() + bias[b.positions % rate]
        dim = e_pool.shape[-1]
        cur = b.positions[:, None] - torch.arange(rate - 1, -1, -1, device=x.device)  # [T, m]
        parts = (
            [(cur - rate, slice(0, dim)), (cur, slice(dim, 2 * dim))] if overlap else [(cur, slice(0, dim))]
        )
        cs, zs = [], []
        for pos, half in parts:
            slots = b.context_slots[owner[:, None], pos.clamp(min=0)]
            cs.append(c_pool[slots][..., half])
            zs.append(z_pool[slots][..., half].masked_fill((pos < 0)[..., None], float("-inf")))
        c_all, z_all = torch.cat(cs, dim=1), torch.cat(zs, dim=1)  # [T, slots, D]
        entry = d.v4_norm((c_all * z_all.softmax(dim=1).to(c_all.dtype)).sum(dim=1), p + "kv_norm.weight")
        cos, sin = d.rope_at((b.positions + 1 - rate).clamp(min=0), "compress")
        e_pool[b.write_slots] = rope_tail(entry[:, None], cos, sin)[:, 0]

    def _indexed(self, i, x, q_res, b: Batch, owner, cache: LayerCache, visible) -> torch.Tensor:
        """CSA: of the visible entries [B, Q, C], those among each query's `index_topk` best scored."""
        d, m, p = self.d, self.m, f"model.layers.{i}.self_attn.compressor.indexer."
        rate = m.compress_rates[CSA]
        self._compress(x, b, owner, p, cache.comp["indexer"], rate, True)
        ikeys, _ = _entries(cache.comp["indexer"][2], b, rate)  # [B, C, Di]
        T, Hi, Di = x.shape[0], m.index_n_heads, m.index_head_dim
        cos, sin = d.rope_at(b.positions, "compress")
        iq = rope_tail(d._project(q_res, p + "q_b_proj.weight").view(T, Hi, Di), cos, sin)
        weights = d._project(x, p + "scorer.weights_proj.weight").float() * Hi**-0.5  # [T, Hi]
        qb, wb = iq[b.query_index].float(), weights[b.query_index]  # [B, Q, Hi, Di], [B, Q, Hi]
        scores = torch.einsum("bqhd,bcd->bqhc", qb, ikeys.float()).relu() * Di**-0.5
        scores = (scores * wb[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        k = min(m.index_topk, scores.shape[-1])
        if k == 0:
            return visible
        chosen = torch.zeros_like(visible).scatter_(-1, scores.topk(k, dim=-1).indices, True)
        return visible & chosen

    def _attend(self, q, keys, bias, ckeys, cbias, b: Batch, sinks) -> torch.Tensor:
        """[T, H, D]: each query over its window's keys, its request's visible entries and the sink
        (the values are the keys). transformers' roundings: logits in the model dtype, the softmax
        with the fp32 sink in fp32, probabilities rounded back, one rounding of the weighted sum."""
        T, scale = q.shape[0], self.m.head_dim**-0.5
        parts = [torch.einsum("thd,twd->thw", q, keys) * scale + bias[:, None].to(q.dtype)]
        if ckeys is not None:
            cl = torch.einsum("bqhd,bcd->bqhc", q[b.query_index], ckeys) * scale + cbias[:, :, None].to(
                q.dtype
            )
            parts.append(to_tokens(cl.flatten(0, 1), b, T))
        parts.append(sinks.float()[None, :, None].expand(T, -1, 1))
        full = torch.cat([x.float() for x in parts], dim=-1)
        probs = torch.softmax(full - full.amax(dim=-1, keepdim=True), dim=-1).to(q.dtype).float()
        W = keys.shape[1]
        out = torch.einsum("thw,twd->thd", probs[..., :W], keys.float())
        if ckeys is not None:
            per_request = torch.einsum("bqhc,bcd->bqhd", probs[..., W:-1][b.query_index], ckeys.float())
            out = out + to_tokens(per_request.flatten(0, 1), b, T)
        return out.to(q.dtype)
