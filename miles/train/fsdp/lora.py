"""LoRA training in the FSDP backend (train.lora), with PEFT (miles.lora.adapters).

The causal LM is wrapped by `peft.get_peft_model` before sharding, and FSDP2 shards the frozen base and
the adapters alike. A run trains one adapter (`train.lora.name`) or several (`train.lora.adapters`):
each is a PEFT adapter of the same model, with its own AdamW and LR schedule (`AdapterSet`); a forward
computes with the one made active, so a micro-batch never mixes adapters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miles.lora.adapters import is_adapter, split_name, wrap
from miles.train.fsdp.sharding import causal_lm
from miles.train.optim import build_optimizer, build_scheduler


def build(lora: Any):
    """A `build` for load_sharded: the causal LM with the run's adapters, base weights frozen."""
    return lambda path: wrap(causal_lm(path), lora)


class AdapterSet:
    """The adapters of a several-adapter run (train.lora.adapters): one AdamW and one LR schedule each,
    over that adapter's parameters alone, so each trains as if it were the only one."""

    def __init__(self, model: nn.Module, lora: Any, train: Any, rank: int) -> None:
        self.model, self.names = model, lora.names
        params: dict[str, list[nn.Parameter]] = {n: [] for n in self.names}
        for name, p in model.named_parameters():
            if is_adapter(name):
                params[split_name(name)[0]].append(p)
        self.optimizers = {n: build_optimizer(params[n], train, rank=rank) for n in self.names}
        self.schedulers = {n: build_scheduler(self.optimizers[n], train) for n in self.names}

    def split(self, samples: list[Any]) -> dict[str, list[Any]]:
        """The step's samples by adapter (`metadata["lora_path"]`, set by the rollout's task)."""
        out: dict[str, list[Any]] = {n: [] for n in self.names}
        for s in samples:
            name = s.metadata.get("lora_path")
            if name not in out:
                raise ValueError(
                    f"sample of group {s.group_id} names adapter {name!r}; this run trains {', '.join(self.names)}"
                )
            out[name].append(s)
        return out

    def state(self) -> tuple[tuple[torch.optim.Optimizer, ...], SchedulerGroup]:
        """What a checkpoint holds: every optimiser (one DCP state dict) and every schedule."""
        return tuple(self.optimizers.values()), SchedulerGroup(self.schedulers)


class SchedulerGroup:
    """The LR schedules of an AdapterSet, saved and restored as one."""

    def __init__(self, schedulers: dict[str, Any]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return {n: s.state_dict() for n, s in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for n, s in self.schedulers.items():
            s.load_state_dict(state[n])
