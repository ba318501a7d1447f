"""train.draft with NEXTN on the Megatron backend, one CUDA rank: the MTP layer trains on the final
hidden states of the policy's own update passes (GPTModel's output processor), the policy's parameters
are bit-identical with and without it, its loss falls, every export ends with the layer under its
checkpoint names, and the checkpoint brings it back. Skipped without CUDA or megatron-core."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from mtp_oracle import check_mtp_training

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core is CUDA-only)"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

PROMPT = [11, 22, 33, 44]


def _plan(model: str, run_dir, with_draft: bool, layout: str):
    from miles.config import resolve

    train = {"backend": "megatron", "lr": 3e-3, "grad_clip": 1.0, "max_tokens_per_microbatch": 16,
             "micro_batch_layout": layout}  # fmt: skip
    if with_draft:
        train["draft"] = {"lr": 1e-2}
    return resolve({
        "model": {"path": model, "dtype": "float32"},
        "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
        "engine": {"speculative": {"algorithm": "NEXTN", "num_steps": 2}},
        "train": train,
    })  # fmt: skip


def _samples():
    from miles.sample import Sample

    resp = [[50, 60, 70, 80], [90, 100, 110], [50, 61, 7, 8, 9]]
    return [Sample(0, i, PROMPT, r, [1] * len(r), [-2.0] * len(r), reward=float(i % 2))
            for i, r in enumerate(resp)]  # fmt: skip


def _params(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.gpt.named_parameters()}


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_mtp_layer_learns_beside_a_bit_identical_megatron_policy(layout, tmp_path) -> None:
    from miles.models.tiny import init_tiny
    from miles.train.draft_model import DraftTraining
    from miles.train.megatron.backend import MegatronBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    model = str(init_tiny(tmp_path / "m", seed=0, mtp=True))
    plain = MegatronBackend()
    plain.setup(_plan(model, tmp_path / "plain", False, layout))
    for _ in range(2):
        plain.train(_samples())
    want = _params(plain)

    backend = DraftTraining(MegatronBackend())
    backend.setup(_plan(model, tmp_path / "mtp", True, layout))
    first = [backend.train(_samples()) for _ in range(2)]
    got = _params(backend.inner)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    check_mtp_training(backend, first, _samples, backend.inner.hf_cfg.num_hidden_layers)
