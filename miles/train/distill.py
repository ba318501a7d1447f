"""On-policy distillation: the teacher's log-probs of the student's own tokens shape the advantage.

The student samples a response; a teacher (another engine, miles/rollout/teacher.py) scores each
sampled token y_t given the same prefix, log q(y_t | y_<t). With the student's log-prob p of that
token under the policy being trained, detached,

    A_t  <-  A_t  -  coef * (log p(y_t | y_<t) - log q(y_t | y_<t))         on trained tokens

so a token the teacher finds likelier than the student does is pushed up and one it finds unlikelier
pushed down. In expectation over the student's samples the shift is the per-token reverse KL
KL(p || q) estimated with its k1 estimator, and the policy-gradient step on it descends that KL.
Where loss_mask is 0 (tool output, user turns) nothing changes. Teacher equal to student: no shift.
`distill/reverse_kl` reports the mean of log p - log q over trained tokens.

`topk_reverse_kl` (train.distill.mode) teaches with the teacher's distribution instead of one
sampled token: at each trained position t the teacher sends its top-k tokens S_t with log-probs
log q(v); with the student's log p(v) over the same tokens (softmax of logits / temperature, with its
gradient) and one bucket for everything else, P = 1 - sum_S p, Q = 1 - sum_S q,

    KL_t = sum_{v in S_t} p(v) (log p(v) - log q(v))  +  P (log P - log Q)

the reverse KL of the two distributions coarsened to k + 1 outcomes: >= 0, 0 exactly when the student
gives each of the teacher's top-k tokens the teacher's probability, and a lower bound of the full
KL(p || q). The loss gains coef * sum_t w_t KL_t (w: the aggregation weights); advantages are not
shifted. `distill_reverse_kl` then reports the mean of KL_t over trained tokens.

Left out here: mixing the shift into a critic's value targets.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6


def shifted_advantages(
    advantages: Tensor, logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float
) -> Tensor:
    """The advantages of a flat token batch after the distillation shift (module docstring);
    `logp` is detached here, so the shift carries no gradient of its own."""
    return advantages - coef * (logp.detach() - teacher_logp) * mask


def reverse_kl_sum(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Sum over trained tokens of log p - log q (detached), for the `distill/reverse_kl` metric."""
    return (mask * (logp.detach() - teacher_logp)).sum()


def topk_logprobs(logits: Tensor, rows: Tensor, ids: Tensor, temperature: float, chunk: int = 1024) -> Tensor:
    """log softmax(logits[rows] / temperature) at `ids` [N, k] in fp32, `chunk` rows at a time (the
    full-vocabulary rows of one chunk are the transient memory)."""
    out = [
        _chunk_logprobs(logits[rows[a : a + chunk]], ids[a : a + chunk], temperature)
        for a in range(0, rows.numel(), chunk)
    ]
    return torch.cat(out) if out else logits.new_zeros((0, ids.shape[-1]), dtype=torch.float32)


def _chunk_logprobs(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    z = logits.float() / temperature
    return z.gather(1, ids) - torch.logsumexp(z, dim=-1, keepdim=True)


def topk_reverse_kl(student: Tensor, teacher: Tensor) -> Tensor:
    """KL_t of the module docstring per token from [N, k] student and teacher log-probs of the
    teacher's top-k tokens (gradient through `student`)."""
    p, q = student.exp(), teacher.exp()
    tail_p = (1.0 - p.sum(-1)).clamp(min=EPS)
    tail_q = (1.0 - q.sum(-1)).clamp(min=EPS)
    return (p * (student - teacher)).sum(-1) + tail_p * (tail_p.log() - tail_q.log())
