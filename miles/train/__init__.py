"""Training: the TrainBackend seam (backend.py), its backends (fsdp/, megatron/), RL objectives
(losses/, objective.py), sequence packing (batching.py), the optimiser (optim.py, offload/).

Backends are plug-ins, imported only when chosen, so `import miles.train` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    "fsdp": "miles.train.fsdp.backend:FSDPBackend",
    "megatron": "miles.train.megatron.backend:MegatronBackend",
}


def get_backend(name: str) -> Any:
    """The backend class registered as `name` (imported now); the error lists the known names."""
    if name not in BACKENDS:
        known = ", ".join(sorted(BACKENDS))
        raise ValueError(f"unknown train backend {name!r} (train.backend); known: {known}")
    module, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
