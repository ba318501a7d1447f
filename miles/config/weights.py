"""How new weights travel from the trainer into the live engines."""

from __future__ import annotations

from typing import Literal

from miles.config.base import Section


class WeightsConfig(Section):
    """Weight synchronisation."""

    transport: Literal["disk", "distributed", "tensor", "lora"] = "distributed"
    """`disk`: safetensors + /update_weights_from_disk; `distributed`: broadcast over an update group;
    `tensor`: CUDA IPC handles / shared memory to engines on the trainer's host (/update_weights_from_tensor;
    the transport of colocated runs, derived for `launch.layout=colocated` unless set); `lora`: the
    adapters alone through /load_lora_adapter_from_tensors (the transport of every `train.lora` run,
    derived for it)."""
    bucket_mb: int = 512
    """Upper bound of one bucket of tensors in MiB."""
    update_interval: int = 1
    """Push weights every N training steps."""
    pause_mode: Literal["abort", "retract", "in_place", "none"] = "in_place"
    """How engines pause around a push: drop, re-queue, or keep (KV included) in-flight requests; `none`: no pause."""
    check: bool = False
    """After each sync, compare engine weights with trainer weights (costly; for tests and debugging)."""
