"""PPO's critic in the FSDP backend: the policy's body with a scalar value head, sharded like it.

`ValueModel` is the Hugging Face base model of the policy's architecture (the decoder without its LM
head) plus `value_head`, a Linear(hidden, 1) that starts at zero, so the first step's
values are 0 and its advantages are the plain returns. The value of a response token is read at the
position whose logits predict it (the state before the token), like its log-prob. The critic has its
own AdamW (train.critic.lr) and LR schedule and is checkpointed beside the policy (fsdp/checkpoint.py).
The maths (GAE, clipped value loss, explained variance) is in miles/train/losses/value.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from miles.config import Plan
from miles.models.families import packs_sequences
from miles.train.batching import Packed
from miles.train.fsdp.sharding import load_sharded
from miles.train.optim import build_optimizer, build_scheduler


class ValueModel(nn.Module):
    """A decoder body and a scalar value head: forward gives one value per position, [B, T]."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.config = body.config
        self._no_split_modules = getattr(body, "_no_split_modules", None)
        self.value_head = nn.Linear(body.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str) -> ValueModel:
        """The body of the causal LM at `path` (its LM head is loaded with it and dropped: the
        checkpoint then loads with no key left over)."""
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        return cls(lm.base_model)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).clone()  # FSDP hooks want a tensor, not a view


def _model_type(path: str) -> str:
    import json
    from pathlib import Path

    return json.loads((Path(path) / "config.json").read_text()).get("model_type", "")


class Critic:
    """The sharded value model with its optimiser and schedule (on every trainer rank)."""

    def __init__(self, plan: Plan, device: torch.device, dtype: torch.dtype, rank: int) -> None:
        c = plan.train.critic
        self.cfg = c
        self.device = device
        self.rows = not packs_sequences(_model_type(c.path or plan.model.path))
        """Micro-batches come as rows of equal-length sequences (the policy's `_rows`)."""
        self.model = load_sharded(
            c.path or plan.model.path, device, dtype, trainable=True, build=ValueModel.from_pretrained
        )
        train = plan.train.model_copy(update={"lr": plan.train.lr if c.lr is None else c.lr})
        self.optimizer = build_optimizer(self.model.parameters(), train, rank=rank)
        self.scheduler = build_scheduler(self.optimizer, train)

    def values(self, packed: Packed) -> Tensor:
        """Values [N] (fp32) of the packed micro-batch's response tokens."""
        ids, pos = packed.rows() if self.rows else (packed.input_ids, packed.position_ids)
        out = self.model(ids.to(self.device), pos.to(self.device))
        return out.reshape(-1).float()[packed.logit_index.to(self.device)]

    def parts(self) -> tuple[nn.Module, Any, Any]:
        return self.model, self.optimizer, self.scheduler
