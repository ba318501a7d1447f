"""NVMe offload under FSDP2: two real gloo ranks, DTensor shards, bit-identical to torch AdamW.

Run as a script, this file is one rank: it builds the same FSDP2 model twice, steps one with
torch.optim.AdamW and the other with OffloadedAdamW (NVMe mode, many small buckets), and writes
whether every local shard matches bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORLD = 2


def _build(mesh):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _worker(rank: int, tmp: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from miles.train.offload import OffloadedAdamW

    torch.set_num_threads(1)  # two ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    ref, off = _build(mesh), _build(mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    (tmp / "nvme").mkdir(exist_ok=True)
    off_opt = OffloadedAdamW(
        off.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        mode="nvme",
        bucket_bytes=8192,
        directory=str(tmp / "nvme"),
        rank=rank,
    )
    for step in range(1, 4):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        for model, opt in ((ref, ref_opt), (off, off_opt)):
            for g in opt.param_groups:
                g["lr"] = 1e-2 / step
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    pairs = list(zip(ref.parameters(), off.parameters(), strict=True))
    result = {
        "dtensor": all(isinstance(p, DTensor) for _, p in pairs),
        "equal": all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs),
        "moved": any(
            not torch.equal(a.to_local(), b.to_local())
            for a, b in zip(_build(mesh).parameters(), off.parameters(), strict=True)
        ),
        "buckets": len(off_opt.buckets),
        "shard_numel": sum(p.to_local().numel() for p in off.parameters()),
    }
    (tmp / f"result{rank}.json").write_text(json.dumps(result))
    off_opt.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_shards_match_torch_adamw(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(tmp_path)], stderr=subprocess.PIPE, text=True
        )
        for rank in range(WORLD)
    ]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0] * WORLD, errs
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(WORLD)]
    total = 64 * 96 + 96 + 96 * 40 + 40
    assert sum(r["shard_numel"] for r in results) == total  # each rank holds only its shard
    for r in results:
        assert r["dtensor"] and r["moved"] and r["equal"] and r["buckets"] >= 3
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == ["rank_00000", "rank_00001"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), Path(sys.argv[2]))
