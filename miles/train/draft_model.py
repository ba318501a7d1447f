"""The speculative draft trained with the policy (`train.draft`; NEXTN's MTP layer: miles/train/mtp_training.py,
through the same wrapper): a STANDALONE draft model
(engine.speculative.draft_model_path) learns, every step, to predict the tokens the policy sampled, so
its proposals keep being accepted as the policy moves away from where the draft started.

    loss = - mean over the step's trained response tokens of log q(token | the sample's prefix)

(next-token cross-entropy of the draft q on the rollout's own tokens, loss mask 1 only: a tool's
output is not the policy's to predict). One AdamW step per training step, on the trainer's rank 0
(the draft is small: one copy, no sharding); the other ranks only take part in the policy's step.

`DraftTraining` wraps any TrainBackend: the policy's step, weights and checkpoints are the wrapped
backend's, untouched (the policy's parameters and gradients are bit-identical with and without the
draft, tests/unit/test_draft_training.py); it adds the draft's step and metrics (`draft/loss`,
`draft/tokens`), appends the draft's tensors under `draft.<HF name>` to every weight export (the
embedded engine loads names with that prefix into its draft model, miles/engine/control.py), and keeps
the draft's weights and optimiser in the checkpoint's trainer state (`extra["draft"]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.sample import Sample
from miles.train.batching import pack, pack_by_budget

if TYPE_CHECKING:
    from miles.train.mtp_training import MtpTrainer

PREFIX = "draft."
"""Weight names of the draft model in an export (the engine strips it)."""


class DraftTrainer:
    """The draft model, its optimiser and its step (rank 0 holds them; None elsewhere)."""

    def __init__(self, plan: Any, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        cfg = plan.train.draft
        path = plan.engine.speculative.draft_model_path
        self.device, self.budget = device, cfg.max_tokens_per_microbatch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.grad_clip = cfg.grad_clip

    def begin(self) -> None:
        """Before the policy's step: nothing (the MTP layer's trainer reads the policy then)."""

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """One optimiser step of the cross-entropy over the samples' trained response tokens."""
        lengths = [len(s.tokens) for s in samples]
        bins = pack_by_budget(lengths, list(range(len(samples))), self.budget)
        tokens = sum(sum(s.loss_mask) for s in samples)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for indices in bins:
            p = pack(samples, indices)
            ids, pos = p.input_ids.to(self.device), p.position_ids.to(self.device)
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            logp = torch.log_softmax(logits.index_select(0, p.logit_index.to(self.device)).float(), -1)
            nll = -logp.gather(1, p.targets.to(self.device)[:, None])[:, 0] * p.mask.to(self.device)
            loss = nll.sum() / max(tokens, 1)
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return {"draft/loss": total, "draft/tokens": float(tokens), "draft/grad_norm": float(norm)}

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        return [(PREFIX + n, t.detach()) for n, t in self.model.state_dict().items()]

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class DraftTraining:
    """A TrainBackend (miles/train/backend.py) that trains the policy with `inner` and the draft beside
    it (module docstring)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.draft: DraftTrainer | MtpTrainer | None = None

    def __getattr__(self, name: str) -> Any:  # the wrapped backend's other parts (offload, model, ...)
        return getattr(self.inner, name)

    def setup(self, plan: Any) -> None:
        self.inner.setup(plan)
        if plan.engine.speculative.algorithm == "NEXTN":  # the MTP layer, on every rank
            from miles.train.mtp_training import MtpTrainer

            config, lm_weights = self.inner.mtp_source()
            self.draft = MtpTrainer(plan, config, self._device(), lm_weights)
            self.inner.hidden_sink = self.draft.absorb
        elif dist.get_rank() == 0:
            self.draft = DraftTrainer(plan, self._device())

    def _device(self) -> torch.device:
        """The policy's device (Megatron's: this rank's current CUDA device)."""
        device = getattr(self.inner, "device", None)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return torch.device(device)

    def train(self, samples: list[Sample]) -> dict[str, float]:
        if self.draft is not None:
            self.draft.begin()
        metrics = self.inner.train(samples)
        if self.draft is not None:
            metrics.update(self.draft.train(samples))
        return metrics

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
        yield from self.inner.export_weights(bucket_bytes)
        yield self.draft.named_tensors() if self.draft is not None and dist.get_rank() == 0 else []

    def save(self, step: int, extra: dict[str, Any] | None = None) -> str:
        extra = dict(extra or {})
        if self.draft is not None:
            extra["draft"] = self.draft.state()
        return self.inner.save(step, extra)

    def load(self, step: int | None = None) -> dict[str, Any]:
        extra = dict(self.inner.load(step))
        state = extra.pop("draft", None)
        if self.draft is not None and state is not None:
            self.draft.restore(state)
        return extra
