"""DeepSeek-V4's hybrid attention as a Megatron module, for training (whole sequences, no cache).

One shared key/value head K = V (kv_proj, RMS-normed), queries through a low-rank path (q_a_proj,
q_a_norm, q_b_proj, an unweighted RMS norm per head), interleaved RoPE on each head's trailing
`rope_dim` channels ("main" rope on sliding layers, the YaRN-scaled "compress" rope on the others;
the engine's `rope_tail` and `unweighted_rms`, miles/engine/hybrid_attention.py),
a learned sink logit per head in the softmax, the conjugate rotation on the output's RoPE slice, and
the grouped low-rank output projection (o_a_proj per group of heads, then o_b_proj). Per layer kind:
- sliding: each query sees the last `sliding_window` tokens (itself included);
- HCA: plus one compressed entry per closed window of `compress_rate` tokens (a softmax-gated sum of
  the window's kv_proj rows, RMS-normed, roped at the window's first position), entry w visible from
  position p when w < (p + 1) / rate;
- CSA: the compressed entries overlap (window w mixes window w-1's first half-projection with its own
  second), and each query sees only the `index_topk` entries the Lightning Indexer scores highest
  (sum over its heads of weight * relu(q . k), its own compressor at `index_head_dim`), among the
  visible ones.
Submodule and parameter names are transformers' (`q_a_proj`, ..., `compressor.indexer.scorer.
weights_proj`), so conversion is one to one. Sequence-first like Megatron ([s, b, h] in and out);
positions are 0..s-1 in every row (DeepSeek-V4 trains unpacked rows). Tensor parallelism is not built
(one rank holds every head).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import nn

from miles.engine.hybrid_attention import rope_tail, unweighted_rms
from miles.engine.rope import frequencies
from miles.engine.v4_spec import CSA, HCA, SLIDING, V4Spec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Compressor(nn.Module):
    """A compressor (HCA: one series; CSA and the indexer: two overlapping series, `overlap`)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[b, n, dim] compressed entries of h [b, s, hidden], n = s // rate, roped at w * rate."""
        b, s, _ = h.shape
        r, d, n = self.rate, self.dim, s // self.rate
        kv = self.kv_proj(h[:, : n * r]).view(b, n, r, -1)
        gate = self.gate_proj(h[:, : n * r]).view(b, n, r, -1) + self.position_bias
        if self.overlap:  # slots [0, r): the previous window's first series; [r, 2r): this window's second
            kv2 = kv.new_zeros(b, n, 2 * r, d)
            gate2 = gate.new_full((b, n, 2 * r, d), float("-inf"))
            kv2[:, :, r:], gate2[:, :, r:] = kv[..., d:], gate[..., d:]
            kv2[:, 1:, :r], gate2[:, 1:, :r] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
            kv, gate = kv2, gate2
        pooled = self.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        at = torch.arange(n, device=h.device) * r
        return rope_tail(pooled.unsqueeze(-2), cos[at], sin[at]).squeeze(-2)


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int, dim: int) -> None:
        super().__init__()
        self.softmax_scale, self.weights_scaling = dim**-0.5, heads**-0.5
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """The Lightning Indexer: its own overlapping compressor, query heads and scorer."""

    def __init__(self, spec: V4Spec, hidden: int, rate: int) -> None:
        super().__init__(hidden, spec.index_head_dim, rate, True, spec.eps)
        self.heads, self.topk = spec.index_n_heads, spec.index_topk
        self.q_b_proj = nn.Linear(spec.q_lora_rank, self.heads * spec.index_head_dim, bias=False)
        self.scorer = IndexerScorer(hidden, self.heads, spec.index_head_dim)

    def pick(
        self, h: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """[b, s, T] additive bias over the compressed entries: 0 at each query's chosen visible ones."""
        b, s, _ = h.shape
        keys = self.forward(h, cos, sin)  # [b, T, dim]
        q = rope_tail(self.q_b_proj(q_res).view(b, s, self.heads, -1), cos[:s], sin[:s])
        scores = F.relu(torch.einsum("bshd,btd->bsht", q.float(), keys.float())) * self.scorer.softmax_scale
        weights = self.scorer.weights_proj(h).float() * self.scorer.weights_scaling
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, T]
        visible = _visible(s, keys.shape[1], self.rate, h.device)
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True) & visible
        return torch.zeros_like(scores).masked_fill(~chosen, float("-inf"))


def _visible(s: int, n: int, rate: int, device) -> torch.Tensor:
    """[s, n] whether compressed entry w is visible from position p: w < (p + 1) // rate."""
    return torch.arange(n, device=device)[None, :] < ((torch.arange(s, device=device) + 1) // rate)[:, None]


class HybridAttention(MegatronModule):
    """DeepSeek-V4's attention of one layer (module docstring)."""

    def __init__(self, config: Any, spec: V4Spec, layer: int) -> None:
        super().__init__(config=config)
        hidden, H, d = config.hidden_size, spec.num_heads, spec.head_dim
        self.spec, self.kind, self.heads, self.head_dim = spec, spec.layer_types[layer], H, d
        self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(spec.q_lora_rank, spec.eps)
        self.q_b_proj = nn.Linear(spec.q_lora_rank, H * d, bias=False)
        self.kv_proj = nn.Linear(hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, spec.eps)
        self.o_a_proj = nn.Linear(H * d // spec.o_groups, spec.o_groups * spec.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(spec.o_groups * spec.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = None
        if self.kind != SLIDING:
            rate = spec.compress_rates[self.kind]
            self.compressor = Compressor(hidden, d, rate, self.kind == CSA, spec.eps)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(spec, hidden, rate)
        kind = "main" if self.kind == SLIDING else "compress"
        inv, factor = frequencies(spec.rope[kind], spec.rope_dim, spec.rope_theta[kind], spec.max_positions,
                                  truncate=spec.rope_truncate)  # fmt: skip
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_factor = factor

    def _cos_sin(self, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(s, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)[None]
        return freqs.cos() * self.rope_factor, freqs.sin() * self.rope_factor

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.transpose(0, 1)  # [b, s, hidden]
        b, s, _ = h.shape
        cos, sin = self._cos_sin(s, h.device)
        q_res = self.q_a_norm(self.q_a_proj(h))
        q = self.q_b_proj(q_res).view(b, s, self.heads, self.head_dim)
        q = rope_tail(unweighted_rms(q, self.spec.eps), cos, sin)
        kv = rope_tail(self.kv_norm(self.kv_proj(h)).unsqueeze(-2), cos, sin).squeeze(-2)  # [b, s, d]
        pos = torch.arange(s, device=h.device)
        window = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.spec.sliding_window)
        bias = torch.zeros(s, s, device=h.device).masked_fill(~window, float("-inf")).expand(b, s, s)
        if self.compressor is not None:
            entries = self.compressor(h, cos, sin)  # [b, T, d]
            if self.kind == HCA:
                seen = _visible(s, entries.shape[1], self.compressor.rate, h.device)
                extra = torch.zeros(s, entries.shape[1], device=h.device).masked_fill(~seen, float("-inf"))
                extra = extra.expand(b, -1, -1)
            else:
                extra = self.compressor.indexer.pick(h, q_res, cos, sin)
            kv, bias = torch.cat([kv, entries], dim=1), torch.cat([bias, extra.to(bias.dtype)], dim=-1)
        logits = torch.einsum("bshd,btd->bhst", q, kv) * self.head_dim**-0.5 + bias.unsqueeze(1)
        sinks = self.sinks.view(1, -1, 1, 1).expand(b, -1, s, 1).to(logits.dtype)
        full = torch.cat([logits, sinks], dim=-1)
        probs = torch.softmax(full - full.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        out = torch.einsum("bhst,btd->bshd", probs.to(kv.dtype), kv)
        out = rope_tail(out, cos, -sin)
        g = self.spec.o_groups
        grouped = out.reshape(b, s, g, -1)
        w = self.o_a_proj.weight.view(g, -1, grouped.shape[-1])
        mixed = torch.einsum("bsgi,goi->bsgo", grouped, w).flatten(2)
        return self.o_b_proj(mixed).transpose(0, 1)
