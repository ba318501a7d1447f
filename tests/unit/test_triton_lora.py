"""The fused LoRA kernel of miles/engine/triton_lora.py on CPU, under Triton's interpreter, against the
bank's PyTorch path (miles/engine/lora.py: A GEMM, mask, block-diagonal B GEMM-accumulate) in fp32:
in place after its own A GEMM (`lora_add_`), and from the output of one GEMM over the weight with A
stacked under it (`lora_split`).

As in test_triton_fused.py, TRITON_INTERPRET would leak into every other kernel of the process, so
the cases run in a child interpreter started with TRITON_INTERPRET=1 (this file run as a script) that
prints one JSON line of measured errors per case. The cases: a q/k/v group of three members of
different widths (one column block straddles nothing: blocks follow members), a single projection,
tokens of several slots and of the base model (slot -1), a token count the block does not divide,
and slots of lower rank than the bank's (zero padding)."""

from __future__ import annotations

import json

import pytest
from interpreted import run_cases

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")


def _case(outs: list[int], width_in: int, tokens: int, slots: int, rank: int, seed: int) -> dict:
    import torch

    from miles.engine.triton_lora import lora_add_, lora_split, member_blocks

    g = torch.Generator().manual_seed(seed)
    n, width = len(outs), slots * rank
    x = torch.randn(tokens, width_in, generator=g)
    a = torch.randn(n * width, width_in, generator=g) * 0.1
    b = torch.zeros(sum(outs), n * width)
    for k, o in enumerate(outs):  # block-diagonal, as the bank stores a group
        r0 = sum(outs[:k])
        b[r0 : r0 + o, k * width : (k + 1) * width] = torch.randn(o, width, generator=g) * 0.1
    a.view(n, slots, rank, width_in)[:, :, rank // 2 :] = 0  # adapters of half the bank's rank
    scale = torch.rand(slots, generator=g) + 0.5
    token_slots = torch.randint(-1, slots, (tokens,), generator=g)
    y0 = torch.randn(tokens, sum(outs), generator=g)
    # the PyTorch path of LoraBank.add_fused
    hit = (torch.arange(width)[None, :] // rank == token_slots[:, None]).float()
    mask = (hit * scale[torch.arange(width) // rank][None, :]).repeat(1, n)
    ref = y0 + ((x @ a.t()) * mask) @ b.t()
    y = y0.clone()
    lora_add_(y, x, a, b, member_blocks(outs), token_slots, scale, rank, width)
    both = torch.cat((y0, x @ a.t()), dim=-1)  # what one GEMM over [W; A] yields
    split = lora_split(both, b, member_blocks(outs), token_slots, scale, rank, width)
    base = token_slots < 0
    return {
        "err": float((y - ref).abs().max()),
        "split_err": float((split - ref).abs().max()),
        "split_shape": list(split.shape),
        "scale": float(ref.abs().max()),
        "base_untouched": bool(torch.equal(y[base], y0[base]) and torch.equal(split[base], y0[base])),
    }


CASES = {
    "qkv": dict(outs=[256, 128, 128], width_in=96, tokens=70, slots=4, rank=8, seed=0),
    "single": dict(outs=[128], width_in=64, tokens=5, slots=2, rank=16, seed=1),
    "one_slot": dict(outs=[128, 384], width_in=128, tokens=130, slots=1, rank=16, seed=2),
}


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_cases(__file__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_lora_kernel_equals_the_pytorch_path(measured, case):
    m = measured[case]
    assert m["err"] <= 1e-4 * max(1.0, m["scale"]), m
    assert m["split_err"] <= 1e-4 * max(1.0, m["scale"]), m
    assert m["split_shape"] == [CASES[case]["tokens"], sum(CASES[case]["outs"])]
    assert m["base_untouched"], "a base-model token (slot -1) was changed"


def test_blocks_follow_members_and_unfit_shapes_fall_back():
    from miles.engine.triton_lora import fits, member_blocks

    assert member_blocks([256, 128, 128]).tolist() == [0, 0, 1, 2]
    assert member_blocks([200]) is None  # not a multiple of the block: PyTorch's path runs
    assert fits(16, 1, 64) and fits(8, 4, 64) and not fits(8, 1, 64) and not fits(16, 3, 64)


if __name__ == "__main__":
    for name, kwargs in CASES.items():
        print(json.dumps({name: _case(**kwargs)}), flush=True)
