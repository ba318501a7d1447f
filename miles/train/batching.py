"""From a step's samples to rank shards and packed micro-batches (shared by the train backends).

Every rank receives the same full list of samples, so every rank can compute every rank's plan
without talking to the others; that is what keeps the number of forward/backward passes (each one
a collective under FSDP) equal on all ranks.

- Sharding: longest sample first, each to the rank holding the fewest tokens so far (ties: lowest
  rank). Deterministic, and balances tokens rather than sample counts.
- Micro-batching is **sequence packing**: first-fit-decreasing into bins of at most
  `max_tokens_per_microbatch` tokens (prompt + response). A sample longer than the budget gets a
  micro-batch of its own. One packed micro-batch is a single row: input_ids [1, T] and
  position_ids [1, T] restarting at 0 for each sequence. Hugging Face models turn such
  position_ids (with attention_mask=None) into a block-diagonal causal mask, so packed sequences
  never attend to each other and the loss equals the unpacked loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.sample import Sample
from miles.train.losses.aggregate import normalizers
from miles.train.losses.fused_logprob import token_logprobs_entropy


def check_samples(samples: Sequence[Sample]) -> None:
    """Raise ValueError naming the first sample whose per-token lists do not match its response."""
    for s in samples:
        n = len(s.response_ids)
        where = f"sample (group_id={s.group_id}, index={s.index})"
        if not s.prompt_ids:
            raise ValueError(f"{where} has no prompt_ids")
        if len(s.loss_mask) != n:
            raise ValueError(f"{where}: loss_mask has {len(s.loss_mask)} entries for {n} response tokens")
        if len(s.rollout_logprobs) != n:
            raise ValueError(
                f"{where}: rollout_logprobs has {len(s.rollout_logprobs)} entries for {n} response tokens "
                "(request return_logprob from the engine)"
            )


def shard_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of samples per rank, balancing total tokens (longest first, to the lightest rank)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shards]


def pack_by_budget(lengths: Sequence[int], indices: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of sample indices whose total length stays within `budget`."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def bins_of_equal_length(lengths, indices: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of sample indices of one length each, at most `budget` tokens a bin (one sequence at
    least): the micro-batches of a family whose forward mixes a packed row (`Family.packs` False),
    stacked as rows of one [B, S] batch instead (`Packed.rows`)."""
    by_length: dict[int, list[int]] = {}
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        by_length.setdefault(lengths[i], []).append(i)
    bins = []
    for n, group in by_length.items():
        per_bin = max(1, budget // max(n, 1))
        bins += [group[k : k + per_bin] for k in range(0, len(group), per_bin)]
    return bins


@dataclass
class Packed:
    """One packed micro-batch: model inputs plus where each response token's prediction sits."""

    samples: list[int]
    """Indices (into the step's sample list) of the packed sequences, in packing order."""
    input_ids: Tensor
    """[1, T] token ids of all packed sequences."""
    position_ids: Tensor
    """[1, T] positions, restarting at 0 for each sequence."""

    def rows(self) -> tuple[Tensor, Tensor]:
        """(input_ids, position_ids) as [B, S] rows, one sequence each (the micro-batch of
        `bins_of_equal_length`); flattened row-major they are the packed order."""
        B = len(self.samples)
        return self.input_ids.view(B, -1), self.position_ids.view(B, -1)

    logit_index: Tensor
    """[N] position in the row whose logits predict each response token."""
    targets: Tensor
    """[N] the response token ids."""
    seq_index: Tensor
    """[N] which packed sequence (0..len(samples)-1) each response token belongs to."""
    mask: Tensor
    """[N] loss_mask as float."""
    rollout_logp: Tensor
    """[N] the engine's log-probs."""
    teacher_logp: Tensor | None = None
    """[N] the distillation teacher's log-probs (train.distill), None when the samples carry none."""
    seq_weight: Tensor | None = None
    """[n_seqs] trajectory weights of the packed sequences (Sample.weight), or None when all are 1."""
    teacher_topk_ids: Tensor | None = None
    """[N, k] the teacher's top-k token ids per response token (distill mode topk_reverse_kl), or None."""
    teacher_topk_logp: Tensor | None = None
    """[N, k] their teacher log-probs, or None."""


def teacher_logprobs(samples: Sequence[Sample]) -> list[float] | None:
    """The samples' teacher log-probs flat in token order, or None when none carries them; a sample
    without them among others that have them is an error (a teacher reply went missing)."""
    have = [bool(s.teacher_logprobs) for s in samples]
    if not any(have):
        return None
    for s in samples:
        if len(s.teacher_logprobs) != s.response_length:
            raise ValueError(
                f"sample (group_id={s.group_id}, index={s.index}) has {len(s.teacher_logprobs)} teacher "
                f"log-probs for {s.response_length} response tokens"
            )
    return [float(x) for s in samples for x in s.teacher_logprobs]


def teacher_topk(samples: Sequence[Sample]) -> tuple[Tensor, Tensor] | None:
    """The samples' teacher top-k (ids [N, k] int64, log-probs [N, k] fp32) in token order, or None
    when none carries them; a sample without them among others that have them is an error."""
    if all(s.teacher_topk is None for s in samples):
        return None
    for s in samples:
        if s.teacher_topk is None or len(s.teacher_topk[0]) != s.response_length:
            raise ValueError(
                f"sample (group_id={s.group_id}, index={s.index}) lacks the teacher's top-k for its "
                f"{s.response_length} response tokens"
            )
    ids = torch.cat([torch.as_tensor(s.teacher_topk[0], dtype=torch.long) for s in samples])
    logp = torch.cat([torch.as_tensor(s.teacher_topk[1], dtype=torch.float32) for s in samples])
    return ids, logp


def pack(samples: Sequence[Sample], indices: Sequence[int]) -> Packed:
    """Build the packed tensors of `indices` (CPU; the backend moves them to its device)."""
    ids: list[int] = []
    pos: list[int] = []
    logit_index: list[int] = []
    targets: list[int] = []
    seq_index: list[int] = []
    mask: list[float] = []
    rollout: list[float] = []
    for k, i in enumerate(indices):
        s = samples[i]
        start = len(ids) + len(s.prompt_ids)
        ids.extend(s.tokens)
        pos.extend(range(len(s.tokens)))
        logit_index.extend(range(start - 1, start - 1 + len(s.response_ids)))
        targets.extend(s.response_ids)
        seq_index.extend([k] * len(s.response_ids))
        mask.extend(float(m) for m in s.loss_mask)
        rollout.extend(float(x) for x in s.rollout_logprobs)
    teacher = teacher_logprobs([samples[i] for i in indices])
    topk = teacher_topk([samples[i] for i in indices])
    weights = [float(samples[i].weight) for i in indices]
    return Packed(
        samples=list(indices),
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        logit_index=torch.tensor(logit_index, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        mask=torch.tensor(mask, dtype=torch.float32),
        rollout_logp=torch.tensor(rollout, dtype=torch.float32),
        teacher_logp=None if teacher is None else torch.tensor(teacher, dtype=torch.float32),
        seq_weight=None if all(w == 1.0 for w in weights) else torch.tensor(weights, dtype=torch.float32),
        teacher_topk_ids=None if topk is None else topk[0],
        teacher_topk_logp=None if topk is None else topk[1],
    )


@dataclass
class RankPlan:
    """What one rank trains in one mini-batch, plus the global counts every rank agrees on."""

    micro_batches: list[list[int]]
    """Sample indices per micro-batch of this rank."""
    n_micro: int
    """Micro-batches every rank runs (the maximum over ranks; short ranks run empty passes)."""
    total_tokens: int
    """Trained tokens (loss_mask 1) in the mini-batch over all ranks."""
    total_seqs: int
    """Sequences with at least one trained token over all ranks."""
    loss_tokens: float = 0.0
    """The loss normalisers (losses/aggregate.py `normalizers`): trained tokens and sequences counted
    with their trajectory weights (equal to the counts above when every weight is 1)."""
    loss_seqs: float = 0.0


def plan_rank(
    samples: Sequence[Sample],
    indices: Sequence[int],
    rank: int,
    world_size: int,
    budget: int,
    equal_lengths: bool = False,
) -> RankPlan:
    """Shard the mini-batch `indices` over ranks and pack this rank's part into micro-batches (with
    `equal_lengths`, of sequences of one length each: `bins_of_equal_length`)."""
    lengths = {i: len(samples[i].tokens) for i in indices}
    ordered = list(indices)
    shards = shard_by_tokens([lengths[i] for i in ordered], world_size)
    binner = bins_of_equal_length if equal_lengths else pack_by_budget
    per_rank = [binner(lengths, [ordered[j] for j in shard], budget) for shard in shards]
    masks = [samples[i].loss_mask for i in indices]
    total_tokens, total_seqs = normalizers(masks)
    loss_tokens, loss_seqs = normalizers(masks, [float(samples[i].weight) for i in indices])
    return RankPlan(
        micro_batches=per_rank[rank],
        n_micro=max(1, max(len(p) for p in per_rank)),
        total_tokens=int(total_tokens),
        total_seqs=int(total_seqs),
        loss_tokens=loss_tokens,
        loss_seqs=loss_seqs,
    )


def response_logprobs(
    logits: Tensor, packed: Packed, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens from the packed row's logits [T, V], fp32.

    The engine samples from softmax(z / temperature) and reports log-probs of that distribution,
    so the trainer scales its logits the same way (losses/fused_logprob.py).
    """
    return token_logprobs_entropy(logits, packed.logit_index, packed.targets, temperature, with_entropy)
