"""Samples -> right-padded micro-batches for GPTModel, and logits -> per-response-token log-probs.

A micro-batch holds whole sequences, right-padded to its longest one, as many as fit the token
budget `max_tokens_per_microbatch` counted with padding (at least one). The logit at position p
predicts token p+1, so response token j of a sample with prompt length P is scored by the logit at
P+j-1. `rows`/`cols` address those logits; every per-token tensor is flat in that order, sequence
after sequence (the layout miles/train/objective.py expects).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles.sample import Sample
from miles.train.losses.fused_logprob import token_logprobs_entropy


@dataclass
class MicroBatch:
    """One forward pass worth of sequences, on the training device."""

    tokens: Tensor
    """[b, s] token ids, right-padded with 0."""
    positions: Tensor
    """[b, s] position ids."""
    rows: Tensor
    cols: Tensor
    """Flat response-token coordinates of the logits that score them."""
    targets: Tensor
    """Flat response token ids."""
    mask: Tensor
    rollout_logp: Tensor
    advantages: Tensor
    seq_index: Tensor
    """Index of each flat token's sequence inside this micro-batch."""
    sample_ids: list[int]
    """Index of each sequence in the list given to `pack`."""


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving split of sequence indices so that b * max_len <= max_tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def pack(samples: list[Sample], advantages: list[float], max_tokens: int, device: torch.device):
    """Micro-batches of `samples` (advantages: one per sample, same order)."""
    groups = plan_micro_batches([len(s.tokens) for s in samples], max_tokens)
    return [_one(samples, advantages, idx, device) for idx in groups]


def _one(samples: list[Sample], advantages: list[float], idx: list[int], device: torch.device) -> MicroBatch:
    seqs = [samples[i] for i in idx]
    width = max(len(s.tokens) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    rows, cols, targets, mask, rollout, adv, seq = [], [], [], [], [], [], []
    for b, s in enumerate(seqs):
        tokens[b, : len(s.tokens)] = torch.tensor(s.tokens)
        n, p = s.response_length, len(s.prompt_ids)
        rows += [b] * n
        cols += range(p - 1, p + n - 1)
        targets += s.response_ids
        mask += s.loss_mask or [1] * n
        rollout += s.rollout_logprobs or [0.0] * n
        adv += [advantages[idx[b]]] * n
        seq += [b] * n
    positions = torch.arange(width).expand(len(seqs), width)

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return MicroBatch(
        tokens=tokens.to(device),
        positions=positions.to(device),
        rows=t(rows, torch.long),
        cols=t(cols, torch.long),
        targets=t(targets, torch.long),
        mask=t(mask, torch.float32),
        rollout_logp=t(rollout, torch.float32),
        advantages=t(adv, torch.float32),
        seq_index=t(seq, torch.long),
        sample_ids=list(idx),
    )


def response_head(
    hidden_states: Tensor,
    output_layer,
    output_weight: Tensor | None,
    runtime_gather_output: bool | None,
    mb: MicroBatch,
    scale_logits=None,
    **_,
) -> Tensor:
    """GPTModel's `output_processor` hook: logits [T, V] at the positions that score the response
    tokens only, one row per flat response token (MicroBatch order).

    GPTModel would apply the LM head to every position and return [b, s, V] logits as a transposed
    copy of its [s, b, V] result; here the final hidden states [s, b, h] of the scoring positions are
    picked first, so no prompt or padding position pays the vocabulary-sized GEMM, and nothing
    vocabulary-sized is transposed."""
    picked = hidden_states[mb.cols, mb.rows].unsqueeze(1)  # [T, 1, h]
    logits, _ = output_layer(picked, weight=output_weight, runtime_gather_output=runtime_gather_output)
    if scale_logits is not None:
        logits = scale_logits(logits)
    return logits.squeeze(1)


def response_logprobs(
    logits: Tensor, mb: MicroBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens under softmax(logits / temperature), fp32,
    from `response_head`'s [T, V] logits (bf16 in bf16 runs: Float16Module is told not to upcast)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    return token_logprobs_entropy(logits, rows, mb.targets, temperature, with_entropy)
