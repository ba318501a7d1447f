"""Shared by the MTP speculation tests (CPU, GPU): an oracle MTP layer for a tiny model."""

from __future__ import annotations

import torch


def oracle_mtp(path) -> str:
    """The tiny model with zero attention / MLP outputs in the target and the MTP layer, and an MTP
    input projection that keeps the next token's embedding: the target predicts x_{t+1} = f(x_t) and
    the layer f(x_{t+1}) = x_{t+2} (tests/unit/test_mtp_speculation.py)."""
    from safetensors.torch import load_file, save_file

    for name in ("model.safetensors", "mtp.safetensors"):
        tensors = load_file(str(path / name))
        for n, t in tensors.items():
            if n.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
            if n.endswith("eh_proj.weight"):
                hidden = t.shape[0]
                t.zero_()
                t[:, :hidden] = torch.eye(hidden)
        save_file(tensors, str(path / name), metadata={"format": "pt"})
    return str(path)
