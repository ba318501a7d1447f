"""The TrainBackend seam: what the RL loop needs from a trainer, whatever does the training.

Backends (registered in miles/train/__init__.py) share this contract; nothing above the backend
changes when `train.backend` changes. Every method is called on every trainer rank, in the same
order, because most of them run collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from miles.config import Plan
from miles.sample import Sample


@runtime_checkable
class TrainBackend(Protocol):
    """A trainer of the policy, running on all trainer ranks of the job.

    - ``setup(plan)``: join (or create) the process group, load the model from
      ``plan.model.path``, build optimiser and LR schedule (and the frozen reference policy when
      ``plan.train.loss.kl_coef > 0``). Must be called once, before anything else.
    - ``train(samples)``: one training step. Every rank receives the same, full list of samples;
      the backend shards it by rank itself. Advantages (from group structure: equal ``group_id``),
      old-policy log-prob recompute and reference forwards happen inside. Returns the step's
      metrics, equal on every rank: at least loss, pg_loss, kl_loss, entropy_loss, kl, entropy,
      clip_frac, grad_norm, lr, tis_weight_mean, tis_clip_frac, logprob_mismatch (mean
      |logp_train - logp_rollout| over trained response tokens), tokens, step_time_s.
    - ``export_weights(bucket_bytes)``: the current weights as full (unsharded) tensors under
      Hugging Face names, streamed as buckets (lists of (name, tensor)) whose total size stays
      within ``bucket_bytes``; a single tensor larger than the bound travels alone. Parameters are
      gathered one at a time: no extra full copy of the model is ever held. It is a collective:
      every rank must iterate the whole iterator. Only rank 0 receives tensors; the other ranks
      receive the same number of buckets, empty.
    - ``save(step, extra)`` / ``load(step)``: the full training state (model, optimiser, LR
      schedule, RNG, step, plus the caller's opaque ``extra`` such as the data position) under
      ``<run_dir>/checkpoints/step_<step>/``, a ``.complete`` marker written last, keeping the last
      ``train.checkpoint.keep_last`` complete checkpoints. ``load(None)`` loads the latest complete
      one. ``load`` returns ``extra``. A checkpoint loads with a different number of ranks.
    - ``offload()`` / ``onload()``: release accelerator memory (weights, gradients, optimiser state
      to host) and bring it back, always as a pair; on CPU both are no-ops. No other method may be
      called between them.
    """

    def setup(self, plan: Plan) -> None: ...

    def train(self, samples: list[Sample]) -> dict[str, float]: ...

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]: ...

    def save(self, step: int, extra: dict[str, Any] | None = None) -> str: ...

    def load(self, step: int | None = None) -> dict[str, Any]: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...
