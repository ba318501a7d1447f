"""Samples -> micro-batches for GPTModel, and logits -> per-response-token log-probs.

Two layouts, chosen by `pack(..., packed=)`:

- **packed** (the default without Transformer Engine): the sequences of a micro-batch lie back to
  back in one row [1, T], T their total length, no padding; as many as fit the token budget
  `max_tokens_per_microbatch` (at least one). Position ids restart at 0 for each sequence, and the
  sequences' offsets `cu_seqlens` [n + 1] (with the longest length) keep each sequence to its own
  earlier tokens: miles' SDPAttention (miles/train/megatron/model.py) runs a variable-length causal
  kernel over them, so no [T, T] mask is ever built. RoPE needs nothing more: GPTModel rotates by the
  row position, and attention scores depend only on the distance between two positions of one
  sequence, which packing leaves unchanged.
- **padded**: one sequence per row, right-padded to the longest, as many as fit the budget counted
  with padding; no mask (the causal one suffices). Used where Transformer Engine's attention is
  installed, since its causal kernels ignore an arbitrary mask.

The logit at position p predicts token p+1, so response token j of a sequence with prompt length P
starting at row offset o is scored by the logit at o+P+j-1. `rows`/`cols` address those logits; every
per-token tensor is flat in that order, sequence after sequence (the layout miles/train/objective.py
expects), so log-probs come out per sample the same way in both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from miles.sample import Sample
from miles.train.batching import teacher_logprobs, teacher_topk
from miles.train.losses.fused_logprob import token_logprobs_entropy


@dataclass
class MicroBatch:
    """One forward pass worth of sequences, on the training device."""

    tokens: Tensor
    """[b, s] token ids: one packed row (b = 1), or right-padded rows (padding 0)."""
    positions: Tensor
    """[b, s] position ids, restarting at 0 for each sequence."""
    cu_seqlens: Tensor | None
    """[n + 1] int32 offsets of the n sequences of a packed row (0, l0, l0 + l1, ..., T); None: one
    sequence per row, the causal mask alone."""
    max_seqlen: int
    """Length of the longest sequence of the micro-batch."""
    rows: Tensor
    cols: Tensor
    """Flat response-token coordinates of the logits that score them."""
    targets: Tensor
    """Flat response token ids."""
    mask: Tensor
    rollout_logp: Tensor
    teacher_logp: Tensor | None
    """Flat distillation-teacher log-probs (train.distill), or None."""
    seq_weight: Tensor | None
    """[n_seqs] trajectory weights of the sequences (Sample.weight), or None when all are 1."""
    teacher_topk_ids: Tensor | None
    """[T, k] the teacher's top-k ids per response token (distill mode topk_reverse_kl), or None."""
    teacher_topk_logp: Tensor | None
    """[T, k] their teacher log-probs, or None."""
    advantages: Tensor
    seq_index: Tensor
    """Index of each flat token's sequence inside this micro-batch."""
    sample_ids: list[int]
    """Index of each sequence in the list given to `pack`."""


def plan_micro_batches(lengths: list[int], max_tokens: int, packed: bool = True) -> list[list[int]]:
    """Greedy, order-preserving split of sequence indices so that each micro-batch holds at most
    `max_tokens` tokens: their sum (packed) or rows x longest (padded); a longer sequence goes alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i, n in enumerate(lengths):
        size = total + n if packed else (len(current) + 1) * max(longest, n)
        if current and size > max_tokens:
            groups.append(current)
            current, longest, total = [], 0, 0
        current.append(i)
        longest, total = max(longest, n), total + n
    if current:
        groups.append(current)
    return groups


def default_packed() -> bool:
    """Packed rows unless Transformer Engine's attention (given no sequence offsets here) is used."""
    from miles.train.megatron.model import has_transformer_engine

    return not has_transformer_engine()


def packed_layout(setting: str) -> bool:
    """Whether `train.micro_batch_layout` = `setting` packs on this node; packed rows with Transformer
    Engine's attention are refused (its layer spec would not see the offsets)."""
    from miles.train.megatron.model import has_transformer_engine

    if setting == "packed" and has_transformer_engine():
        raise ValueError(
            "train.micro_batch_layout=packed needs miles' attention, but Transformer Engine is installed "
            "and its attention is used; set train.micro_batch_layout to auto or padded"
        )
    return default_packed() if setting == "auto" else setting == "packed"


def pack(
    samples: list[Sample],
    advantages: Sequence[float | Tensor],
    max_tokens: int,
    device: torch.device,
    packed: bool | None = None,
) -> list[MicroBatch]:
    """Micro-batches of `samples` (advantages: one per sample, same order, a number or a per-token
    tensor); `packed` None: the
    default layout (`default_packed`)."""
    packed = default_packed() if packed is None else packed
    groups = plan_micro_batches([len(s.tokens) for s in samples], max_tokens, packed)
    return [_one(samples, advantages, idx, device, packed) for idx in groups]


def cu_seqlens(lengths: list[int], device: torch.device | None = None) -> Tensor:
    """[n + 1] int32 cumulative offsets of sequences of `lengths` laid back to back, from 0."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    return offsets.to(device)


def _one(
    samples: list[Sample],
    advantages: Sequence[float | Tensor],
    idx: list[int],
    device: torch.device,
    packed: bool,
) -> MicroBatch:
    seqs = [samples[i] for i in idx]
    lengths = [len(s.tokens) for s in seqs]
    b, width = (1, sum(lengths)) if packed else (len(seqs), max(lengths))
    tokens = torch.zeros(b, width, dtype=torch.long)
    positions = torch.zeros(b, width, dtype=torch.long)
    rows, cols, targets, mask, rollout, adv, seq = [], [], [], [], [], [], []
    offset = 0
    for k, s in enumerate(seqs):
        row = 0 if packed else k
        n, p, length = s.response_length, len(s.prompt_ids), len(s.tokens)
        tokens[row, offset : offset + length] = torch.tensor(s.tokens)
        positions[row, offset : offset + length] = torch.arange(length)
        rows += [row] * n
        cols += range(offset + p - 1, offset + p + n - 1)
        targets += s.response_ids
        mask += s.loss_mask or [1] * n
        rollout += s.rollout_logprobs or [0.0] * n
        a = advantages[idx[k]]
        adv.append(a.float() if isinstance(a, Tensor) else torch.full((n,), float(a)))
        seq += [k] * n
        offset += length if packed else 0
    teacher = teacher_logprobs(seqs)
    topk = teacher_topk(seqs)
    weights = [float(s.weight) for s in seqs]
    if not packed:
        positions = torch.arange(width).expand(b, width)
    offsets = cu_seqlens(lengths, device) if packed and len(seqs) > 1 else None

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return MicroBatch(
        tokens=tokens.to(device),
        positions=positions.to(device),
        cu_seqlens=offsets,
        max_seqlen=max(lengths),
        rows=t(rows, torch.long),
        cols=t(cols, torch.long),
        targets=t(targets, torch.long),
        mask=t(mask, torch.float32),
        rollout_logp=t(rollout, torch.float32),
        teacher_logp=None if teacher is None else t(teacher, torch.float32),
        seq_weight=None if all(w == 1.0 for w in weights) else t(weights, torch.float32),
        teacher_topk_ids=None if topk is None else topk[0].to(device),
        teacher_topk_logp=None if topk is None else topk[1].to(device),
        advantages=torch.cat(adv).to(device),
        seq_index=t(seq, torch.long),
        sample_ids=list(idx),
    )


def one_row(mb: MicroBatch) -> SimpleNamespace:
    """The micro-batch's rows back to back as one packed row, as the MTP layer's training reads a
    micro-batch (miles/train/mtp_training.py): input_ids and position_ids [1, b * s] (a padded row's
    positions run on over its padding, which no mask marks), logit_index the flat index of each
    response token's scoring position, mask the response tokens' loss mask."""
    s = mb.tokens.shape[1]
    return SimpleNamespace(input_ids=mb.tokens.reshape(1, -1), position_ids=mb.positions.reshape(1, -1),
                           logit_index=mb.rows * s + mb.cols, mask=mb.mask)  # fmt: skip


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
