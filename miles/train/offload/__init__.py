"""Optimiser state offload: AdamW with its state in host memory (`cpu`) or streamed from node-local NVMe (`nvme`).

The trainer calls `build_optimizer(params, cfg, rank)` when `train.optimizer_offload != "none"`
and gets a torch.optim.Optimizer; checkpoints call its `save_state(dir)` / `load_state(dir)`.

    layout.py      parameters -> buckets, 4 KiB-aligned byte images
    adamw.py       the update maths (bit-exact torch AdamW in fp32)
    device.py      host <-> device copies overlapped with compute (identity on CPU)
    fileio.py      O_DIRECT / buffered sequential I/O of images
    store.py       host-memory store and the versioned, pipelined NVMe store
    checkpoint.py  save/load of the streamed state, marker last
    checks.py      up-front checks of the offload directory and OffloadError
    optimizer.py   OffloadedAdamW and build_optimizer
"""

from miles.train.offload.checks import OffloadError
from miles.train.offload.optimizer import OffloadedAdamW, build_optimizer

__all__ = ["OffloadError", "OffloadedAdamW", "build_optimizer"]
