"""CUDA tensors handed to another process in SGLang's /update_weights_from_tensor format (CUDA IPC
handles pickled by torch's reductions) are rebuilt by miles.weights.tensor.TensorUnpickler, the
restricted unpickler the engine reads request bodies with: the values arrive, a pickle naming
anything else is refused."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch

from miles.weights.tensor import deserialize, pack, serialize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RECEIVER = """
import sys, torch
from miles.weights.tensor import deserialize
named = deserialize(sys.stdin.read())
print(";".join(f"{n}:{t.device.type}:{t.dtype}:{float(t.float().sum()):.6f}" for n, t in named))
"""


def test_cuda_ipc_payloads_pass_the_restricted_unpickler() -> None:
    torch.manual_seed(0)
    named = pack([("w", torch.randn(64, 32, device="cuda")), ("b", torch.randn(7, device="cuda").bfloat16())])
    torch.cuda.synchronize()
    payload = serialize(named)
    out = subprocess.run([sys.executable, "-c", RECEIVER], input=payload, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(item.split(":", 1) for item in out.stdout.strip().split(";"))
    for name, t in named:
        assert got[name] == f"cuda:{t.dtype}:{float(t.float().sum()):.6f}"


def test_a_pickle_naming_anything_else_is_refused_on_the_gpu_host(tmp_path) -> None:
    class Run:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    with pytest.raises(pickle.UnpicklingError, match="refused global"):
        deserialize(base64.b64encode(pickle.dumps([("w", Run())])).decode())
    assert not (tmp_path / "ran").exists()
