"""Sharding and sequence packing: budgets, balance, equal pass counts, and packed == unpacked."""

from __future__ import annotations

import random

import pytest
import torch

from miles.sample import Sample
from miles.train.batching import (
    check_samples,
    pack,
    pack_by_budget,
    plan_rank,
    response_logprobs,
    shard_by_tokens,
)


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(2, 6), rng.randint(1, 8)
        ids = [rng.randrange(5, 300) for _ in range(p + r)]
        mask = [rng.randint(0, 1) for _ in range(r)]
        out.append(Sample(i // 2, i % 2, ids[:p], ids[p:], mask, [-1.0] * r))
    return out


def test_shard_balances_tokens_longest_first() -> None:
    assert shard_by_tokens([5, 3, 8, 2, 7], 2) == [[1, 2, 3], [0, 4]]
    assert shard_by_tokens([4], 3) == [[0], [], []]


def test_pack_respects_budget_and_keeps_every_sample_once() -> None:
    lengths = [9, 3, 7, 2, 5, 12, 1]
    bins = pack_by_budget(lengths, range(len(lengths)), budget=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1  # the 12-token sample travels alone
    assert [5] in bins


def test_rank_plans_agree_on_pass_count_and_totals() -> None:
    samples = _samples(9)
    plans = [plan_rank(samples, list(range(9)), r, 2, budget=16) for r in range(2)]
    assert plans[0].n_micro == plans[1].n_micro == max(len(p.micro_batches) for p in plans)
    assert sorted(i for p in plans for mb in p.micro_batches for i in mb) == list(range(9))
    assert plans[0].total_tokens == sum(sum(s.loss_mask) for s in samples)
    assert plans[0].total_seqs == sum(1 for s in samples if sum(s.loss_mask))


def test_check_samples_names_the_problem() -> None:
    good = _samples(1)[0]
    bad = Sample(3, 1, [1, 2], [3, 4], [1], [-1.0, -1.0])
    check_samples([good])
    with pytest.raises(ValueError, match=r"group_id=3, index=1.*loss_mask has 1 entries for 2"):
        check_samples([good, bad])
    with pytest.raises(ValueError, match="return_logprob"):
        check_samples([Sample(0, 0, [1], [2, 3], [1, 1], [])])


def test_packed_forward_equals_unpacked(tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    samples = _samples(4, seed=1)
    packed = pack(samples, [0, 1, 2, 3])
    assert packed.position_ids[0].tolist() == [p for s in samples for p in range(len(s.tokens))]
    with torch.no_grad():
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        together, _ = response_logprobs(out.logits[0], packed, temperature=0.7)
        alone = []
        for i in range(4):
            single = pack(samples, [i])
            alone.append(response_logprobs(model(input_ids=single.input_ids).logits[0], single, 0.7)[0])
    assert torch.allclose(together, torch.cat(alone), atol=1e-5)
    # and it would notice cross-sequence attention: one long position range changes the result
    with torch.no_grad():
        flat = model(input_ids=packed.input_ids, use_cache=False).logits[0]
    assert not torch.allclose(response_logprobs(flat, packed, 0.7)[0], together, atol=1e-3)
