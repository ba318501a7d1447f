"""On-policy distillation's advantage shift (miles/train/distill.py) and its configuration."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config import ConfigError, resolve
from miles.config.train import LossConfig
from miles.train.distill import shifted_advantages
from miles.train.objective import TokenBatch, policy_objective

T = torch.tensor


def test_teacher_equal_to_student_leaves_advantages_unchanged() -> None:
    adv, logp, mask = T([1.0, -0.5, 2.0]), T([-0.3, -1.7, -2.2]), T([1.0, 1.0, 0.0])
    assert torch.equal(shifted_advantages(adv, logp, logp.clone(), mask, coef=0.7), adv)


def test_known_log_prob_pairs_give_the_exact_shift() -> None:
    adv = T([1.0, 1.0, 1.0, 1.0])
    student = T([-1.0, -3.0, -2.0, -2.0])
    teacher = T([-3.0, -1.0, -2.5, -9.0])
    mask = T([1.0, 1.0, 1.0, 0.0])
    # A - coef (s - t): 1 - 0.5*2, 1 - 0.5*(-2), 1 - 0.5*0.5, masked token untouched
    got = shifted_advantages(adv, student, teacher, mask, coef=0.5)
    assert got.tolist() == pytest.approx([0.0, 2.0, 0.75, 1.0])


def test_the_shift_carries_no_gradient_of_its_own() -> None:
    logp = T([-1.0, -2.0], requires_grad=True)
    out = shifted_advantages(T([0.0, 0.0]), logp, T([-2.0, -2.0]), T([1.0, 1.0]), 1.0)
    assert not out.requires_grad and out.tolist() == [-1.0, 0.0]


def _batch(logp, teacher=None) -> TokenBatch:
    return TokenBatch(
        logp=logp,
        old_logp=logp.detach().clone(),
        rollout_logp=logp.detach().clone(),
        advantages=T([1.0, 1.0, -2.0]),
        mask=T([1.0, 1.0, 1.0]),
        weights=torch.full((3,), 1 / 3),
        seq_index=T([0, 0, 1]),
        n_seqs=2,
        teacher_logp=teacher,
    )


def test_objective_with_the_student_as_teacher_equals_the_plain_objective() -> None:
    logp_a = T([-0.5, -1.0, -2.0], requires_grad=True)
    logp_b = T([-0.5, -1.0, -2.0], requires_grad=True)
    plain, _ = policy_objective(_batch(logp_a), LossConfig())
    same, sums = policy_objective(_batch(logp_b, logp_b.detach().clone()), LossConfig(), distill_coef=1.0)
    plain.backward()
    same.backward()
    assert same.item() == plain.item() and torch.equal(logp_a.grad, logp_b.grad)
    assert sums["distill_reverse_kl"].item() == 0.0


def test_objective_pushes_up_what_the_teacher_prefers() -> None:
    """On-policy (ratio 1) the gradient of the loss on token t is -w_t A_t: a teacher that finds the first
    token likelier than the student does raises its advantage, one that finds it unlikelier lowers it."""
    logp = T([-2.0, -2.0, -2.0], requires_grad=True)
    loss, sums = policy_objective(_batch(logp, T([-1.0, -3.0, -2.0])), LossConfig(), distill_coef=1.0)
    loss.backward()
    # advantages after the shift: 1 + 1, 1 - 1, -2 + 0
    assert (-logp.grad * 3).tolist() == pytest.approx([2.0, 0.0, -2.0])
    assert sums["distill_reverse_kl"].item() == pytest.approx(-1.0 + 1.0 + 0.0)


@pytest.mark.parametrize("distill", [{}, {"teacher_urls": ["http://127.0.0.1:1"], "teacher_model": "m"}])
def test_exactly_one_teacher_source(distill) -> None:
    with pytest.raises(ConfigError, match="exactly one of train.distill.teacher_urls"):
        resolve({"train": {"distill": distill}})
    assert resolve({"train": {"distill": {"teacher_urls": ["http://127.0.0.1:1"]}}}).train.distill.coef == 1.0


def test_topk_reverse_kl_is_zero_at_the_teacher_and_positive_elsewhere() -> None:
    from miles.train.distill import topk_reverse_kl

    teacher = torch.log(torch.tensor([[0.5, 0.3, 0.1]]))  # tail 0.1
    assert topk_reverse_kl(teacher.clone(), teacher).item() == pytest.approx(0.0, abs=1e-6)
    student = torch.log(torch.tensor([[0.2, 0.2, 0.2]]))  # tail 0.4
    want = sum(p * math.log(p / q) for p, q in [(0.2, 0.5), (0.2, 0.3), (0.2, 0.1), (0.4, 0.1)])
    assert topk_reverse_kl(student, teacher).item() == pytest.approx(want, rel=1e-5)


def test_topk_logprobs_and_the_gradient_move_the_student_to_the_teacher() -> None:
    from miles.train.distill import topk_logprobs, topk_reverse_kl

    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    rows, ids = torch.tensor([1, 3, 4]), torch.tensor([[0, 5], [2, 3], [10, 1]])
    got = topk_logprobs(logits, rows, ids, temperature=0.7, chunk=2)
    want = (logits[rows] / 0.7).log_softmax(-1).gather(1, ids)
    assert torch.allclose(got, want, atol=1e-6)
    teacher = torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.7, 0.2]]))
    opt = torch.optim.SGD([logits], lr=1.0)
    start = topk_reverse_kl(topk_logprobs(logits, rows, ids, 0.7), teacher).sum().item()
    for _ in range(200):
        opt.zero_grad()
        topk_reverse_kl(topk_logprobs(logits, rows, ids, 0.7), teacher).sum().backward()
        opt.step()
    end = topk_reverse_kl(topk_logprobs(logits, rows, ids, 0.7), teacher).sum().item()
    assert end < 0.01 * start
    assert torch.allclose(topk_logprobs(logits, rows, ids, 0.7).exp(), teacher.exp(), atol=0.02)


def test_the_metadata_key_picks_each_samples_teacher_and_the_rest_take_turns() -> None:
    from miles.rollout.teacher import Teacher
    from miles.sample import Sample

    a, b = object(), object()
    teacher = Teacher([a, b], key="teacher")  # type: ignore[list-item]
    keyed = [Sample(0, i, [1], [2], [1], [0.0], metadata={"teacher": i % 2}) for i in range(4)]
    assert [teacher._client_of(s) for s in keyed] == [a, b, a, b]
    plain = [Sample(0, i, [1], [2], [1], [0.0]) for i in range(3)]
    assert [teacher._client_of(s) for s in plain] == [a, b, a]
