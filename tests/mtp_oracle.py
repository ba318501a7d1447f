"""Shared by the MTP tests (CPU, GPU): an oracle MTP layer for a tiny model, and the checks of an MTP
layer trained with the policy (train.draft) that every backend must pass."""

from __future__ import annotations

import torch


def oracle_mtp(path) -> str:
    """The tiny model with zero attention / MLP (and MoE experts') outputs in the target and the MTP layer, and an MTP
    input projection that keeps the next token's embedding: the target predicts x_{t+1} = f(x_t) and
    the layer f(x_{t+1}) = x_{t+2} (tests/unit/test_mtp_speculation.py)."""
    from safetensors.torch import load_file, save_file

    for name in ("model.safetensors", "mtp.safetensors"):
        tensors = load_file(str(path / name))
        for n, t in tensors.items():
            if n.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):  # stacked experts too
                t.zero_()
            if n.endswith("eh_proj.weight"):
                hidden = t.shape[0]
                t.zero_()
                t[:, :hidden] = torch.eye(hidden)
        save_file(tensors, str(path / name), metadata={"format": "pt"})
    return str(path)


def check_mtp_training(backend, first: list[dict], samples, num_layers: int) -> None:
    """`backend` (DraftTraining, NEXTN) after the two steps of metrics `first` on `samples()`: the MTP
    tokens counted, its loss falling over six more steps, the last export bucket the layer under its
    checkpoint names, and a checkpoint bringing the layer back."""
    # positions t with x_{t+1} and x_{t+2} both trained response tokens: (4-1) + (3-1) + (5-1)
    assert first[0]["draft/tokens"] == 9.0
    losses = [m["draft/loss"] for m in first] + [backend.train(samples())["draft/loss"] for _ in range(6)]
    assert losses[-1] < losses[0] * 0.8, losses
    mtp = dict(list(backend.export_weights(1 << 20))[-1])
    pre = f"model.layers.{num_layers}."
    assert {pre + "eh_proj.weight", pre + "enorm.weight", pre + "self_attn.q_proj.weight"} <= set(mtp)
    assert all(n.startswith(pre) for n in mtp)
    backend.save(8, extra={"pos": 8})
    saved = {n: t.clone() for n, t in mtp.items()}
    backend.train(samples())
    assert backend.load(8) == {"pos": 8}
    assert all(torch.equal(saved[n], t) for n, t in backend.draft.named_tensors())
