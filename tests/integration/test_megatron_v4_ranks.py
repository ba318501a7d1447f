"""DeepSeek-V4 of Miles' Megatron modules (miles/train/megatron/deepseek_v4_model.py) over ranks on the
CPU, real megatron-core parallel state over gloo (megatron_v4_ranks.py, under torchrun): PP=2 with an
uneven split (layers 3 / 2, the last stage one layer short) and EP=2 (half the routed experts per rank,
each rank its own row of the batch, megatron-core's MoE layer exchanging the tokens) give the one-rank
run's loss and every parameter's gradient. PP moves the same numbers up to rounding: within 1e-5
relative (seen on a 2-core AVX2 machine: 1.7e-6 for layer 0's hyper-connection head, up to 5e-6 run to
run on gradients of norm ~1e-6, which are therefore compared relative to a thousandth of the largest
gradient's norm; under 1e-6 on other machines). EP sums the two
rows' contributions in another order: within 1e-4 relative (the largest gaps are on gradients of norm
~1e-6, the hyper-connection head's). Skipped without megatron-core."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

RANKS = Path(__file__).with_name("megatron_v4_ranks.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    from miles.models.tiny import init_tiny

    root = tmp_path_factory.mktemp("v4-ranks")
    model = init_tiny(root / "v4", arch="deepseek_v4", seed=1)
    out = {}
    for name, (pp, ep) in {"single": (1, 1), "pp2": (2, 1), "ep2": (1, 2)}.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp * ep}"]
        done = subprocess.run([*cmd, str(RANKS), str(model), str(root / name), str(pp), str(ep)],
                              capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])  # fmt: skip
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        out[name] = [json.loads((root / name / f"rank{r}.json").read_text()) for r in range(pp * ep)]
    return out


@pytest.mark.parametrize(("layout", "tol"), [("pp2", 1e-5), ("ep2", 1e-4)])
def test_layout_equals_one_rank(runs, layout, tol):
    (single,) = runs["single"]
    ranks = runs[layout]
    seen = set()
    # a gradient far smaller than the model's largest (the hyper-connection heads', ~1e-6) is compared
    # against a thousandth of the largest: its own norm is mostly rounding there
    floor = 1e-3 * max(torch.tensor(g).norm().item() for g in single["grads"].values())
    for res in ranks:
        if "loss" in res:
            assert abs(res["loss"] - single["loss"]) <= 1e-5 * abs(single["loss"])
        for name, g in res["grads"].items():
            ref = torch.tensor(single["grads"][name])
            err = ((torch.tensor(g) - ref).norm() / max(ref.norm().item(), floor)).item()
            assert err <= tol, f"{layout}: {name}: relative gradient error {err:.2e}"
            seen.add(name)
    assert seen == set(single["grads"])  # every parameter is held somewhere
    if layout == "pp2":
        layers = [{int(n.split(".")[1]) for n in r["grads"] if n.startswith("layers.")} for r in ranks]
        assert layers == [{0, 1, 2}, {3, 4}]
