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

Left out here: the top-k reverse KL variant (a full-distribution term over the teacher's top-k
tokens), and mixing the shift into a critic's value targets.
"""

from __future__ import annotations

from torch import Tensor


def shifted_advantages(
    advantages: Tensor, logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float
) -> Tensor:
    """The advantages of a flat token batch after the distillation shift (module docstring);
    `logp` is detached here, so the shift carries no gradient of its own."""
    return advantages - coef * (logp.detach() - teacher_logp) * mask


def reverse_kl_sum(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Sum over trained tokens of log p - log q (detached), for the `distill/reverse_kl` metric."""
    return (mask * (logp.detach() - teacher_logp)).sum()
