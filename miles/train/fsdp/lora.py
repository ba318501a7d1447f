"""LoRA training in the FSDP backend (train.lora), with PEFT.

The causal LM is wrapped by `peft.get_peft_model` before sharding: every target linear layer gains
`lora_A.<adapter>` [r, in] and `lora_B.<adapter>` [out, r] (B starts at zero, so step 0 is the base
model), the base weights are frozen (`requires_grad=False`: no gradient, no optimiser state), and FSDP2
shards both. A run trains one adapter (`train.lora.name`) or several (`train.lora.adapters`): each is a
PEFT adapter of the same model, with its own AdamW and LR schedule (`AdapterSet`); a forward computes
with the one made active, so a micro-batch never mixes adapters.

The adapters leave the trainer as `<adapter>/<PEFT saved name>` (`<adapter>/base_model.model.<module>
.lora_A.weight`): the saved names are what `/load_lora_adapter_from_tensors` takes and what
`adapter_model.safetensors` holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from miles.train.fsdp.sharding import causal_lm
from miles.train.optim import build_optimizer, build_scheduler


def peft_config(lora: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def adapter_config(lora: Any, base_path: str) -> dict[str, Any]:
    """The adapter_config.json of the run's adapters (PEFT's own serialisation of the config)."""
    cfg = peft_config(lora).to_dict()
    cfg["base_model_name_or_path"] = base_path
    cfg["target_modules"] = sorted(cfg["target_modules"])
    return cfg


def wrap(model: nn.Module, lora: Any) -> nn.Module:
    """`model` with every adapter of train.lora (PEFT), the first one active."""
    from peft import get_peft_model

    names = lora.names
    model = get_peft_model(model, peft_config(lora), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, peft_config(lora))
    return model


def build(lora: Any):
    """A `build` for load_sharded: the causal LM with the run's adapters, base weights frozen."""
    return lambda path: wrap(causal_lm(path), lora)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def freeze_base(model: nn.Module) -> int:
    """requires_grad only on the adapters; returns the trainable parameter count."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        n += p.numel() if p.requires_grad else 0
    return n


_ADAPTER_PART = re.compile(r"\.(lora_[AB])\.([^.]+)\.")


def split_name(name: str) -> tuple[str, str]:
    """(adapter, PEFT's saved name) of an adapter parameter's module name."""
    m = _ADAPTER_PART.search(name)
    if m is None:
        raise ValueError(f"{name} is not a LoRA parameter")
    return m.group(2), name[: m.start()] + f".{m.group(1)}." + name[m.end() :]


def adapter_tensors(
    model: nn.Module, dtype: Any = None, adapter: str | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(`<adapter>/<saved name>`, full tensor) of every adapter parameter, or of one adapter's
    (collective under FSDP: every rank iterates)."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        which, saved = split_name(name)
        if adapter is not None and which != adapter:
            continue
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield f"{which}/{saved}", t if dtype is None else t.to(dtype)


def activate(model: nn.Module, name: str) -> None:
    """Make adapter `name` the one every LoRA layer computes with. Unlike PEFT's `set_adapter`, this
    leaves requires_grad alone: every adapter stays trainable, and one that is not active simply
    gets no gradient."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module._active_adapter = name


def write_adapter(model: nn.Module, name: str, base_path: str, out: Path) -> Path:
    """PEFT's directory of adapter `name` (adapter_config.json + adapter_model.safetensors), which
    `peft.PeftModel.from_pretrained(base, out)` loads."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = model.peft_config[name]
    cfg.base_model_name_or_path = base_path
    cfg.save_pretrained(str(out))
    state = get_peft_model_state_dict(model, adapter_name=name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"))
    return out


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
