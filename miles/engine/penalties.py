"""Logit shaping before sampling, for requests whose options ask for it (SGLang's penalizers,
logit bias and grammar mask, sglang/srt/sampling/penaltylib and sampling_batch_info.py).

With c_t the number of times token t appears in the request's output so far (prompt tokens do not
count, as SGLang), each shaped row is, in this order:
    repetition:  z_t <- z_t * r if z_t < 0 else z_t / r, for tokens with c_t > 0
    frequency:   z_t <- z_t - f * c_t
    presence:    z_t <- z_t - p * [c_t > 0]
    min_new_tokens: z_t <- -inf for stop tokens (stop_token_ids and EOS) while the output is shorter
    grammar:     z_t <- -inf for tokens the request's grammar does not allow next (xgrammar bitmask)
    logit_bias:  z_t <- z_t + b_t
The sampler then draws from softmax(z' / T) and reports its log-probs (as SGLang does by default).
Only the rows of requests that shape are touched; other rows of the batch are left as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from miles.engine.grammar import mask_rows

if TYPE_CHECKING:
    from miles.engine.request import Request


def shape_logits(reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """`logits` [B, vocab] with the rows of shaping requests replaced by their shaped rows (grammar
    masks of all rows at once, the rest row by row)."""
    rows = [i for i, r in enumerate(reqs) if r.opts is not None and r.opts.shapes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        logits[i] = _penalise(reqs[i], logits[i])
    grammar = [i for i in rows if reqs[i].opts.grammar is not None]
    if grammar:
        index = torch.tensor(grammar, device=logits.device)
        logits[index] = mask_rows([reqs[i].opts.grammar for i in grammar], logits[index])
    for i in rows:
        if reqs[i].opts.bias:
            ids, vals = reqs[i].opts.bias
            dev = logits.device
            logits[i] = logits[i].index_add(0, torch.tensor(ids, device=dev), torch.tensor(vals, device=dev))
    return logits


def _penalise(req: Request, z: torch.Tensor) -> torch.Tensor:
    """Penalties and min_new_tokens on one row."""
    o = req.opts
    if o.frequency_penalty or o.presence_penalty or o.repetition_penalty != 1.0:
        if o.counts is None:  # from the output so far (a request retracted and resumed keeps its output)
            o.counts = torch.zeros(z.shape[0], device=z.device)
            if req.output:
                o.counts.index_add_(
                    0, torch.tensor(req.output, device=z.device), torch.ones(len(req.output), device=z.device)
                )
        seen = o.counts > 0
        if o.repetition_penalty != 1.0:
            r = o.repetition_penalty
            z = torch.where(seen, torch.where(z < 0, z * r, z / r), z)
        z = z - o.frequency_penalty * o.counts - o.presence_penalty * seen.float()
    if o.min_new_tokens and len(req.output) < o.min_new_tokens and o.min_stop_ids:
        z = z.index_fill(0, torch.tensor(o.min_stop_ids, device=z.device), float("-inf"))
    return z
