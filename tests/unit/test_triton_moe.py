"""The fused expert kernels of miles/engine/triton_moe.py on CPU, under Triton's interpreter, against
the looped PyTorch path of miles/engine/moe.py in fp32.

As in test_triton_lora.py, TRITON_INTERPRET would leak into every other kernel of the process, so
the cases run in a child interpreter started with TRITON_INTERPRET=1 (this file run as a script) that
prints one JSON line per case. The cases cover each tile setting of `tiles` (16- and 32-row blocks of
decode, 64 rows for prefill), a single token routed to more experts than it has rows, experts that
get no row, dimensions the tiles do not divide, and the layout itself: every (token, slot) row in
exactly one block of its own expert, ranges aligned to the block, the rest the sentinel."""

from __future__ import annotations

import json

import pytest
from interpreted import run_cases

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")


def _case(tokens: int, k: int, experts: int, hidden: int, inter: int, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    from miles.engine import moe, triton_moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate = torch.randn(experts, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = moe.route(x, gate, k, True)
    ref = moe.experts_looped(x, ids, weights, gate_up, down)
    y = triton_moe.experts_fused(x, ids, gate_up, down, lambda gu: F.silu(gu[:, :inter]) * gu[:, inter:])
    out = moe._combine(x, y, weights)

    bm = triton_moe.tiles(tokens * k / experts)["BM"]
    rows, block_expert, used = triton_moe.align(ids, experts, bm)
    rows, block_expert, used = rows.tolist(), block_expert.tolist(), int(used)
    tk, flat = tokens * k, ids.reshape(-1).tolist()
    live = [(i, r) for i, r in enumerate(rows[:used]) if r != tk]
    return {
        "bm": bm,
        "err": float((out - ref).abs().max()),
        "scale": float(ref.abs().max()),
        "each_row_once": sorted(r for _, r in live) == list(range(tk)),
        "own_expert": all(block_expert[i // bm] == flat[r] for i, r in live),
        "sentinel_after": all(r == tk for r in rows[used:]),
        "aligned": used % bm == 0 and used <= len(rows),
    }


CASES = {
    "decode": dict(tokens=12, k=4, experts=16, hidden=64, inter=48, seed=0),
    "decode_32": dict(tokens=24, k=4, experts=16, hidden=64, inter=48, seed=5),
    "one_token": dict(tokens=1, k=8, experts=32, hidden=32, inter=32, seed=1),
    "rows_32": dict(tokens=40, k=2, experts=2, hidden=48, inter=40, seed=2),
    "prefill_64": dict(tokens=150, k=2, experts=4, hidden=80, inter=24, seed=3),
    "odd_experts": dict(tokens=9, k=3, experts=5, hidden=32, inter=16, seed=4),
    # tiles that divide every dimension: the weight loads take no mask
    "even_16": dict(tokens=12, k=4, experts=16, hidden=128, inter=128, seed=6),
    "even_32": dict(tokens=24, k=4, experts=16, hidden=128, inter=128, seed=7),
}


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_cases(__file__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_experts_equal_the_looped_path(measured, case):
    m = measured[case]
    assert m["err"] <= 1e-5 * max(1.0, m["scale"]), m
    assert m["each_row_once"] and m["own_expert"], f"rows misplaced: {m}"
    assert m["sentinel_after"] and m["aligned"], f"layout: {m}"


def test_tiles_cover_decode_and_prefill():
    from miles.engine.triton_moe import tiles

    assert [tiles(n)["BM"] for n in (1, 4, 5, 64, 65, 4096)] == [16, 16, 32, 32, 64, 64]


if __name__ == "__main__":
    for name, kwargs in CASES.items():
        print(json.dumps({name: _case(**kwargs)}), flush=True)
