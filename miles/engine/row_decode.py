"""CPU decode over RowKV rows (`Decoder.forward_rows`, miles/engine/model.py).

Every running request also has a row of a dense per-request cache (miles/engine/kv_cache.py RowKV,
[rows, kv_heads, capacity, head_dim] per layer) holding a copy of its K/V at positions 0..len-1. A
decode step writes the new token's K/V to the pool and to the row, and attention reads
rows[:span, :, :context] as a strided view (batch = row, heads = kv head, G queries per head): no
per-layer copy of every context, which on CPU cost as much as the attention. Rows without a request in
this step get a zero query that sees key 0 only and their output is dropped. The forward may carry the
prompts of newly admitted requests as well: all tokens share the matmuls, and only the prompts'
attention takes the gathering path. `dec` is the Decoder whose weights and sublayers it calls.
"""

from __future__ import annotations

import torch

from miles.engine.kv_cache import gather_slots
from miles.engine.packing import to_tokens
from miles.engine.spec import Batch, token_slots


def attend_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v as two batched matmuls: for the few queries per head of CPU
    decode, ~3x faster on 2 threads than the fused CPU attention kernel, which splits the work too
    finely. k and v may be strided views."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def row_mask(dec, b: Batch, span: int) -> torch.Tensor:
    """[span, 1, 1, context] additive mask for CPU row decode: row r sees keys 0..its position;
    rows without a request see key 0 only (a finite softmax over a zero query)."""
    key_pos = torch.arange(b.context_slots.shape[1], device=b.positions.device)
    row_pos = b.positions.new_zeros(span).index_copy_(0, b.kv_rows, b.positions)
    mask = torch.zeros(span, key_pos.shape[0], dtype=dec.dtype, device=key_pos.device)
    return mask.masked_fill_(key_pos[None, :] > row_pos[:, None], float("-inf"))[:, None, None, :]


def attend_rows(dec, i: int, q, k, v, b: Batch, pool, mask, rows) -> torch.Tensor:
    """CPU decode attention [B, H*D] over the requests' RowKV rows, read in place (module docstring)."""
    s = dec.spec
    B, KVH, D, G = q.shape[0], s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
    k_pool, v_pool = pool[i]
    k_pool[:, b.write_slots] = k.transpose(0, 1)
    v_pool[:, b.write_slots] = v.transpose(0, 1)
    k_rows, v_rows = rows[i]
    k_rows[b.kv_rows, :, b.positions] = k
    v_rows[b.kv_rows, :, b.positions] = v
    span, L = mask.shape[0], mask.shape[-1]
    qr = q.view(B, KVH, G, D)
    if span != B:  # rows are ascending, so span == B means they are exactly 0..B-1
        qr = qr.new_zeros(span, KVH, G, D).index_copy_(0, b.kv_rows, qr)
    out = attend_cpu(qr, k_rows[:span, :, :L], v_rows[:span, :, :L], mask)
    if span != B:
        out = out.index_select(0, b.kv_rows)
    return out.reshape(B, s.num_heads * D)


def attend_pool_cpu(dec, i: int, q, k, v, b: Batch, pool, mask) -> torch.Tensor:
    """CPU prefill attention [T, H*D]: writes the new K/V to the pool and gathers each request's
    context from it (as `_attention` does), with the matmul attention of the rows path."""
    s = dec.spec
    T, (B, Q) = q.shape[0], b.query_index.shape
    KVH, D, G = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
    k_pool, v_pool = pool[i]
    k_pool[:, b.write_slots] = k.transpose(0, 1)
    v_pool[:, b.write_slots] = v.transpose(0, 1)
    L = b.context_slots.shape[1]
    kb = gather_slots(k_pool, b.context_slots).view(KVH * B, 1, L, D)
    vb = gather_slots(v_pool, b.context_slots).view(KVH * B, 1, L, D)
    qb = q[b.query_index].view(B, Q, KVH, G, D).permute(2, 0, 3, 1, 4).reshape(KVH * B, 1, G * Q, D)
    out = attend_cpu(qb, kb, vb, mask)
    out = out.view(KVH, B, G, Q, D).permute(1, 3, 0, 2, 4).reshape(B * Q, s.num_heads * D)
    return to_tokens(out, b, T)


def forward_rows(
    dec,
    d: Batch,
    pool: list[tuple[torch.Tensor, torch.Tensor]],
    rows: list[tuple[torch.Tensor, torch.Tensor]],
    row_span: int,
    prefill: Batch | None = None,
) -> torch.Tensor:
    """CPU: logits (fp32) [P + B, vocab] at the last new token of each prefill request, then of
    each decode request, from one forward over both (they share every matmul; only attention is
    split). Decode requests (`d.kv_rows` set) read their RowKV rows, valid up to their position,
    over rows [0, row_span); prefill requests gather their context from the pool. The new K/V
    go to the pool, and the decode tokens' to their rows as well."""
    parts = [d] if prefill is None else [prefill, d]
    ids, positions = torch.cat([b.input_ids for b in parts]), torch.cat([b.positions for b in parts])
    if dec.lora is not None:  # no slots in any part: the base model alone
        named = any(b.lora_slots is not None for b in parts)
        dec.lora.terms.begin(torch.cat([token_slots(b) for b in parts]) if named else None)
    n_pre = 0 if prefill is None else prefill.input_ids.shape[0]
    x = dec.params["model.embed_tokens.weight"][ids]
    freqs = positions.float()[:, None] * dec.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    rows_mask = row_mask(dec, d, row_span)
    pre_mask = None if prefill is None else dec._fold_mask(prefill)
    for i in range(dec.spec.num_layers):
        p = f"model.layers.{i}."
        q, k, v = dec._qkv(i, dec._norm(x, dec.params[p + "input_layernorm.weight"]), cos, sin)
        out = attend_rows(dec, i, q[n_pre:], k[n_pre:], v[n_pre:], d, pool, rows_mask, rows)
        if prefill is not None:
            pre = attend_pool_cpu(dec, i, q[:n_pre], k[:n_pre], v[:n_pre], prefill, pool, pre_mask)
            out = torch.cat((pre, out))
        x = x + dec._project(out, p + "self_attn.o_proj.weight")
        x = x + dec._mlp(i, dec._norm(x, dec.params[p + "post_attention_layernorm.weight"]))
    last = d.last_index if prefill is None else torch.cat((prefill.last_index, n_pre + d.last_index))
    dec._take_routing(d.write_slots if prefill is None else torch.cat((prefill.write_slots, d.write_slots)))
    return dec._logits(dec._norm(x[last], dec.params["model.norm.weight"]), last)
