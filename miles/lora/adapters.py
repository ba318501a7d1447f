"""The PEFT side of LoRA (train.lora), shared by both trainers, export and the loop.

- `peft_config` / `adapter_config`: the run's PEFT `LoraConfig` and the adapter_config.json every
  adapter is served and written with (the loop hands it to the engines with each push);
- `wrap`, `freeze_base`, `activate`: the causal LM under `peft.get_peft_model` (every target linear
  layer gains `lora_A.<adapter>` [r, in] and `lora_B.<adapter>` [out, r], B zero so step 0 is the base
  model; base weights frozen), several adapters of one model, one active per forward;
- `adapter_tensors`, `split_name`: the adapters as they leave a trainer, `<adapter>/<PEFT saved name>`
  (`<adapter>/base_model.model.<module>.lora_A.weight`: `wire_name`), the
  saved names being what `/load_lora_adapter_from_tensors` takes and `adapter_model.safetensors` holds;
- `write_adapter`: PEFT's directory of one adapter (export, checkpoints' adapters).

The FSDP backend wraps before sharding (miles/train/fsdp/lora.py); the Megatron backend keeps its own
fused layers and maps their names to PEFT's (miles/train/megatron/lora.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def wire_name(adapter: str, saved: str) -> str:
    """The name an adapter tensor leaves a trainer under: `<adapter>/<PEFT saved name>`."""
    return f"{adapter}/{saved}"


def split_wire_name(name: str) -> tuple[str, str]:
    """(adapter, PEFT saved name) of an adapter tensor's name as it left the trainer."""
    adapter, _, saved = name.partition("/")
    return adapter, saved


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
        yield wire_name(which, saved), t if dtype is None else t.to(dtype)


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
