"""RL objectives as pure functions on tensors; the train backends compose them (see objective.py).

One file per idea, each stating its maths: advantages.py (GRPO, REINFORCE++, GSPO and the
ADVANTAGE_ESTIMATORS registry), policy.py (PPO-clip, clip-higher, dual clip, GSPO ratio), kl.py
(k1/k2/k3, as loss or reward penalty), entropy.py, tis.py (truncated / masked importance weights),
aggregate.py (token- or sequence-level aggregation with global normalisers), fused_logprob.py (token
log-probs and entropies from the selected logit rows; Triton kernels on CUDA in triton_logprob.py).
"""

from miles.train.losses.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator, get_estimator
from miles.train.losses.aggregate import aggregate, token_weights
from miles.train.losses.entropy import entropy_from_logits
from miles.train.losses.fused_logprob import token_logprobs_entropy
from miles.train.losses.kl import kl_estimate, kl_penalty
from miles.train.losses.policy import ppo_clip_loss, sequence_log_ratio
from miles.train.losses.tis import clipped_sequences, tis_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "aggregate",
    "clipped_sequences",
    "entropy_from_logits",
    "get_estimator",
    "kl_estimate",
    "kl_penalty",
    "ppo_clip_loss",
    "sequence_log_ratio",
    "tis_weights",
    "token_logprobs_entropy",
    "token_weights",
]
