"""Megatron LoRA (miles/train/megatron/lora.py) over tensor- and pipeline-parallel ranks, on the CPU:
real megatron-core layers over gloo (megatron_lora_ranks.py, under torchrun). In each layout the
logits and every adapter tensor's gradient equal PEFT's model holding the same adapter, only the
adapters train, and the adapter that leaves the trainer (gathered over the pipeline stages) is the
same in every layout. Skipped without megatron-core."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

RANKS = Path(__file__).with_name("megatron_lora_ranks.py")
LAYOUTS = {"single": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Each layout's output directory, after its ranks ran."""
    root = tmp_path_factory.mktemp("megatron-lora")
    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp * pp}"]
        cmd += [str(RANKS), tiny_model, str(root / name), str(tp), str(pp)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        out[name] = root / name
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_adapter_gradients_equal_peft(runs, layout):
    tp, pp = LAYOUTS[layout]
    results = [json.loads((runs[layout] / f"rank{r}.json").read_text()) for r in range(tp * pp)]
    layers = 2  # the tiny model's
    for r, res in enumerate(results):
        assert res["trainable"] and all(".lora_A_" in n or ".lora_B_" in n for n in res["trainable"])
        assert len(res["trainable"]) == 14 * layers // pp  # A and B of 7 projections per layer of the stage
        worst = max(res["grad_err"].values())
        print(f"{layout} rank {r}: logits {res.get('logits_err')}, worst adapter gradient {worst:.2e}")
        assert worst < 1e-4, res["grad_err"]
    last = results[-1]  # the last pipeline stage's first tensor-parallel rank holds the logits
    assert last["logits_err"] < 1e-5


def test_every_layout_exports_the_same_adapter(runs):
    import torch

    single = torch.load(runs["single"] / "adapter.pt")
    assert len(single) == 14 * 2
    for layout in ("tp2", "pp2"):
        other = torch.load(runs[layout] / "adapter.pt")
        assert other.keys() == single.keys()
        assert all(torch.equal(other[k], single[k]) for k in single), layout
