"""The RL objective of one micro-batch, composed from the pure functions in miles/train/losses/.

For the flat response tokens of a micro-batch (log-probs under the current policy `logp`, the old
policy `old_logp`, the engine `rollout_logp`, optionally the reference `ref_logp`):

    A_t    = A_i(t) + [kl_in_reward] kl_penalty(k(old, ref))        advantage per token
             - [distill logprob] coef (logp_t - teacher_t), logp detached   (miles/train/distill.py)
    l_t    = logp_t - old_t   (GSPO: the sequence mean of l, broadcast)
    pg_t   = w_tis_t * ppo_clip_loss(l_t, A_t)
    loss   = sum_t w_t pg_t  +  kl_coef sum_t w_t k(logp, ref)_t  -  entropy_coef sum_t w_t H_t
             + [distill topk_reverse_kl] coef sum_t w_t KL_t(top-k of the teacher)

w are the global aggregation weights (aggregate.py), so the per-micro-batch losses of all ranks add
up to the step's loss. Backends are responsible for the forward passes and the gradient scaling;
both compute logp and H with losses/fused_logprob.py (H is always reported as a metric and enters
the loss, with its gradient, only when entropy_coef > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from miles.config.train import LossConfig
from miles.train.distill import reverse_kl_sum, shifted_advantages, topk_reverse_kl
from miles.train.losses import clipped_sequences, kl_estimate, kl_penalty, ppo_clip_loss, tis_weights
from miles.train.losses.policy import sequence_log_ratio


@dataclass
class TokenBatch:
    """Flat response tokens of one micro-batch; every tensor has one entry per token."""

    logp: Tensor
    """Log-probs of the sampled tokens under the policy being trained (carries the gradient)."""
    old_logp: Tensor
    rollout_logp: Tensor
    advantages: Tensor
    """The sample's advantage, repeated on each of its tokens."""
    mask: Tensor
    """1.0 where the token is trained on (loss_mask), else 0.0."""
    weights: Tensor
    """Global aggregation weights (aggregate.token_weights)."""
    seq_index: Tensor
    n_seqs: int
    ref_logp: Tensor | None = None
    entropy: Tensor | None = None
    """Entropy of the policy at each token (fused_logprob.py), for the metric and the entropy bonus;
    it enters the loss (and so gets a gradient) only when entropy_coef > 0."""
    teacher_logp: Tensor | None = None
    """The distillation teacher's log-prob of each token (train.distill mode logprob), or None."""
    student_topk_logp: Tensor | None = None
    """[N, k] the policy's log-probs (with gradient) of the teacher's top-k tokens (mode topk_reverse_kl)."""
    teacher_topk_logp: Tensor | None = None
    """[N, k] the teacher's log-probs of its top-k tokens (mode topk_reverse_kl), or None."""


def _shaped_advantages(tb: TokenBatch, cfg: LossConfig, mask: Tensor, distill_coef: float) -> Tensor:
    """The per-token advantages with the reward-side terms: the KL penalty (kl_in_reward) and the
    teacher's shift (distillation by log-probs)."""
    advantages = tb.advantages
    if tb.ref_logp is not None and cfg.kl_in_reward:
        kl_old = kl_estimate(tb.old_logp, tb.ref_logp, cfg.kl_estimator)
        advantages = advantages + kl_penalty(kl_old, mask, tb.seq_index, tb.n_seqs, cfg.kl_coef)
    if tb.teacher_logp is not None:
        advantages = shifted_advantages(advantages, tb.logp, tb.teacher_logp, mask, distill_coef)
    return advantages


def policy_objective(
    tb: TokenBatch, cfg: LossConfig, sequence_ratio: bool = False, distill_coef: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to back-propagate and detached metric sums.

    Metric sums come in three kinds: names ending in `_loss` are already weighted (sum over the whole
    batch gives the value); names ending in `_seq_frac` count sequences (divide by the number of
    sequences with a trained token); the others are sums over trained tokens (divide by the token
    count). tis_clip_frac is the share of trained tokens TIS truncated or masked, tis_clip_seq_frac
    the share of sequences with at least one such token.
    """
    mask = tb.mask.to(tb.logp.dtype)
    advantages = _shaped_advantages(tb, cfg, mask, distill_coef)
    log_ratio = tb.logp - tb.old_logp
    if sequence_ratio:
        log_ratio = sequence_log_ratio(log_ratio, mask, tb.seq_index, tb.n_seqs)
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    pg, clipped = ppo_clip_loss(log_ratio, advantages, cfg.eps_clip, eps_high, cfg.dual_clip)
    w_tis, tis_hit = tis_weights(tb.old_logp, tb.rollout_logp, cfg.tis, cfg.tis_clip)
    pg_loss = (tb.weights * w_tis * pg).sum()
    zero = pg_loss.detach() * 0
    kl_loss, kl_sum = zero, zero
    if tb.ref_logp is not None:
        kl = kl_estimate(tb.logp, tb.ref_logp, cfg.kl_estimator)
        kl_sum = (mask * kl).sum().detach()
        if not cfg.kl_in_reward and cfg.kl_coef > 0:
            kl_loss = cfg.kl_coef * (tb.weights * kl).sum()
    entropy_loss, entropy_sum = zero, zero
    if tb.entropy is not None:
        entropy_sum = (mask * tb.entropy).sum().detach()
        if cfg.entropy_coef > 0:
            entropy_loss = -cfg.entropy_coef * (tb.weights * tb.entropy).sum()
    loss = pg_loss + kl_loss + entropy_loss
    sums = {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "kl_loss": kl_loss.detach(),
        "entropy_loss": entropy_loss.detach(),
        "kl": kl_sum,
        "entropy": entropy_sum,
        "clip_frac": (mask * clipped).sum(),
        "tis_weight": (mask * w_tis).sum(),
        "tis_clip_frac": (mask * tis_hit).sum(),
        "tis_clip_seq_frac": clipped_sequences(tis_hit, mask, tb.seq_index, tb.n_seqs),
    }
    sums["distill_reverse_kl"] = zero
    if tb.teacher_logp is not None:
        sums["distill_reverse_kl"] = reverse_kl_sum(tb.logp, tb.teacher_logp, mask)
    if tb.teacher_topk_logp is not None and tb.student_topk_logp is not None:
        kl_t = topk_reverse_kl(tb.student_topk_logp, tb.teacher_topk_logp)
        loss = loss + distill_coef * (tb.weights * kl_t).sum()
        sums["loss"] = loss.detach()
        sums["distill_reverse_kl"] = (mask * kl_t).sum().detach()
    return loss, sums
