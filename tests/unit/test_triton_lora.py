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


def _token_slots(tokens: int, slots: int, g, used: list[int] | None = None):
    """Each token's slot: any of the bank's or the base model's (-1), or one of `used` (a tile's
    kernels then skip the slot columns of the others)."""
    import torch

    if used is None:
        return torch.randint(-1, slots, (tokens,), generator=g)
    return torch.tensor(used)[torch.randint(len(used), (tokens,), generator=g)]


def _case(
    outs: list[int],
    width_in: int,
    tokens: int,
    slots: int,
    rank: int,
    seed: int,
    used: list[int] | None = None,
) -> dict:
    import torch

    from miles.engine.triton_lora import lora_add_, lora_split, member_blocks, slot_order

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
    token_slots = _token_slots(tokens, slots, g, used)
    y0 = torch.randn(tokens, sum(outs), generator=g)
    # the PyTorch path of LoraBank.add_fused
    hit = (torch.arange(width)[None, :] // rank == token_slots[:, None]).float()
    mask = (hit * scale[torch.arange(width) // rank][None, :]).repeat(1, n)
    ref = y0 + ((x @ a.t()) * mask) @ b.t()
    y = y0.clone()
    lora_add_(y, x, a, b, member_blocks(outs), token_slots, scale, rank, width)
    both = torch.cat((y0, x @ a.t()), dim=-1)  # what one GEMM over [W; A] yields
    split = lora_split(both, b, member_blocks(outs), token_slots, scale, rank, width)
    # the tiles taking the tokens by slot
    by_slot = lora_split(
        both, b, member_blocks(outs), token_slots, scale, rank, width, slot_order(token_slots, slots)
    )
    y_by_slot = y0.clone()
    lora_add_(
        y_by_slot,
        x,
        a,
        b,
        member_blocks(outs),
        token_slots,
        scale,
        rank,
        width,
        slot_order(token_slots, slots),
    )
    base = token_slots < 0
    return {
        "err": float((y - ref).abs().max()),
        "split_err": float((split - ref).abs().max()),
        "by_slot_err": max(float((by_slot - ref).abs().max()), float((y_by_slot - ref).abs().max())),
        "split_shape": list(split.shape),
        "scale": float(ref.abs().max()),
        "base_untouched": bool(torch.equal(y[base], y0[base]) and torch.equal(split[base], y0[base])),
    }


def _silu_case(
    inter: int, tokens: int, slots: int, rank: int, seed: int, used: list[int] | None = None
) -> dict:
    """lora_split_silu against lora_split then silu_mul, the two kernels it replaces, in fp32 on values
    whose products and sums are exact in any order (multiples of 1/32 of a few units), so that the two
    tilings of the B product agree bit for bit. (bf16 is left to the GPU tests: the interpreter's bf16
    tl.dot is wrong, for `lora_split` too.)"""
    import torch

    from miles.engine.triton_fused import silu_mul
    from miles.engine.triton_lora import lora_split, lora_split_silu, member_blocks, slot_order

    g = torch.Generator().manual_seed(seed)

    def dyadic(*shape: int) -> torch.Tensor:
        return torch.randint(-8, 9, shape, generator=g).float() / 8

    width = slots * rank
    b = torch.zeros(2 * inter, 2 * width)
    b[:inter, :width] = dyadic(inter, width) / 4
    b[inter:, width:] = dyadic(inter, width) / 4
    both = torch.cat(
        (dyadic(tokens, 2 * inter) * 4, dyadic(tokens, 2 * width), torch.zeros(tokens, 7)), dim=1
    )
    scale = torch.tensor([0.5, 1.5, 2.0, 1.0] * slots)[:slots]
    token_slots = _token_slots(tokens, slots, g, used)
    want = silu_mul(lora_split(both, b, member_blocks([inter, inter]), token_slots, scale, rank, width))
    got = lora_split_silu(both, b, token_slots, scale, rank, width)
    by_slot = lora_split_silu(both, b, token_slots, scale, rank, width, slot_order(token_slots, slots))
    return {
        "equal": bool(torch.equal(got, want)),
        "by_slot_equal": bool(torch.equal(by_slot, want)),
        "shape": list(got.shape),
        "scale": float(want.abs().max()),
    }


def _reference_split(both, b, token_slots, scale, rank: int, width: int, members: int):
    """What `lora_split` computes, through the bank's PyTorch path (mask, block-diagonal B product)."""
    import torch

    n = b.shape[0]
    hit = (torch.arange(width)[None, :] // rank == token_slots[:, None]).float()
    mask = (hit * scale[torch.arange(width) // rank][None, :]).repeat(1, members)
    return both[:, :n] + (both[:, n : n + members * width] * mask) @ b.t()


def _rope_case(
    heads: int, kv_heads: int, head_dim: int, tokens: int, slots: int, rank: int, qk_norm: bool, seed: int
) -> dict:
    """rope_store_kv given a q/k/v group's adapters' part (the term added inside the kernel) against
    rope_store_kv of lora_split's output, on values whose sums are exact in any order: q, and k and v
    in the pools."""
    import torch

    from miles.engine.triton_fused import rope_store_kv

    g = torch.Generator().manual_seed(seed)

    def dyadic(*shape: int) -> torch.Tensor:
        return torch.randint(-8, 9, shape, generator=g).float() / 8

    width, outs = slots * rank, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    n = sum(outs)
    b = torch.zeros(n, 3 * width)
    for k, o in enumerate(outs):
        b[sum(outs[:k]) : sum(outs[: k + 1]), k * width : (k + 1) * width] = dyadic(o, width) / 4
    both = torch.cat((dyadic(tokens, n) * 4, dyadic(tokens, 3 * width), torch.zeros(tokens, 3)), dim=1)
    scale = torch.tensor([0.5, 1.5, 2.0, 1.0] * slots)[:slots]
    token_slots = torch.randint(-1, slots, (tokens,), generator=g)
    freqs = torch.rand(tokens, head_dim // 2, generator=g) * 6
    write = torch.randperm(2 * tokens, generator=g)[:tokens]
    norms = (1 + dyadic(head_dim) / 4, 1 + dyadic(head_dim) / 4) if qk_norm else (None, None)
    out = {}
    for fused in (False, True):
        pools = [torch.zeros(kv_heads, 2 * tokens, head_dim) for _ in range(2)]
        if fused:
            lora = (both[:, n : n + 3 * width], b, token_slots, scale, rank, width)
            qkv = both[:, :n]
        else:  # what lora_split writes, through the PyTorch path (exact on these values)
            lora, qkv = None, _reference_split(both, b, token_slots, scale, rank, width, members=3)
        q = rope_store_kv(qkv, freqs.cos(), freqs.sin(), *pools, write, heads, *norms, eps=1e-6, lora=lora)
        out[fused] = (q, *pools)
    return {
        "equal": [bool(torch.equal(a, c)) for a, c in zip(out[True], out[False], strict=True)],
        "err": max(float((a - c).abs().max()) for a, c in zip(out[True], out[False], strict=True)),
    }


def _decoder_case(seed: int) -> dict:
    """The CUDA forward (Decoder.fused_forward.forward) of a decoder whose adapters' A is stacked under its
    weights, gate/up through lora_split_silu, against the per-op forward with the bank's PyTorch path,
    on a prefill of two requests: one on an adapter, one on the base model."""
    import torch
    from test_engine_widen import peft_tensors
    from test_triton_fused import EPS, _weight_shapes

    from miles.engine import triton_lora
    from miles.engine.lora import TARGETS, AdapterConfig, LoraBank
    from miles.engine.lora_terms import CONSUMERS
    from miles.engine.model import Batch, Decoder, ModelSpec

    spec = ModelSpec("Qwen2ForCausalLM", 50, 128, 2, 4, 2, 64, 10000.0, EPS, False, 512, (1,))
    gen = torch.Generator().manual_seed(seed)
    shapes = _weight_shapes(spec, inter=128)
    weights = {n: torch.randn(s, generator=gen) * (0.2 if len(s) > 1 else 1.0) for n, s in shapes.items()}
    dec = Decoder(spec, weights, "cpu", torch.float32)
    rank, slots = 8, 2
    dec.lora = LoraBank.for_decoder(dec, slots, rank, TARGETS, 4, kernels=True)  # Triton's interpreter
    tensors = peft_tensors(dec.lora, rank, gen, 0.2)
    dec.lora.load("x", AdapterConfig(rank, 16.0, TARGETS[:-1]), tensors, "t")
    dec.lora.terms.fuse_consumers = CONSUMERS  # every consumer kernel that can add the term (default: FUSED)
    calls = {"silu": 0, "split": 0, "rope": 0}
    silu, split, rope = triton_lora.lora_split_silu, dec.lora.terms.split, dec.lora.terms.rope_parts

    def counted(kind, fn):
        def call(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return call

    triton_lora.lora_split_silu = counted("silu", silu)
    dec.lora.terms.split = counted("split", split)
    dec.lora.terms.rope_parts = counted("rope", rope)
    prefill = Batch(
        input_ids=torch.tensor([5, 6, 7, 8, 9]), positions=torch.tensor([0, 1, 2, 0, 1]),
        write_slots=torch.tensor([1, 2, 3, 4, 5]), query_index=torch.tensor([[0, 1, 2], [3, 4, 0]]),
        query_pos=torch.tensor([[0, 1, 2], [0, 1, -1]]), context_slots=torch.tensor([[1, 2, 3], [4, 5, 0]]),
        last_index=torch.tensor([2, 4]), lora_slots=torch.tensor([0, 0, 0, -1, -1]),
    )  # fmt: skip
    dec.lora.terms.begin(prefill.lora_slots)
    fused = dec.fused_forward.forward(prefill, dec.new_kv_pool(8))
    fused_into = {
        c: sorted(k for k in dec.lora.stacked if dec.lora.terms.fuses_next(k, c)) for c in CONSUMERS
    }
    silu_groups = [k for k in fused_into["silu"] if k.endswith(".gate_up_proj")]
    split_groups = sorted(
        k for k in dec.lora.stacked if dec.lora.terms.stacks(k) and k.endswith(("o_proj", "down_proj"))
    )
    rope_groups = [k for k in fused_into["rope"] if k.endswith(".qkv_proj")]
    dec.lora.terms.blocks = {}  # the per-op forward and the bank's PyTorch path (A read from the stacked rows)
    per_op = dec.forward(prefill, dec.new_kv_pool(8))
    dec.lora.load("x", AdapterConfig(rank, 16.0, TARGETS[:-1]), {k: v * 0 for k, v in tensors.items()}, "t")
    base = dec.forward(prefill, dec.new_kv_pool(8))
    return {
        "err": float((fused - per_op).abs().max()),
        "scale": float(per_op.abs().max()),
        "adapter_shows": float((per_op[0] - base[0]).abs().max()),
        "base_row_err": float((per_op[1] - base[1]).abs().max()),
        "silu_groups": silu_groups,
        "split_groups": split_groups,
        "rope_groups": rope_groups,
        "calls": calls,
    }


ROPE_CASES = {
    "rope": dict(heads=4, kv_heads=2, head_dim=16, tokens=7, slots=2, rank=8, qk_norm=False, seed=8),
    "rope_qk_norm": dict(heads=6, kv_heads=2, head_dim=8, tokens=5, slots=8, rank=16, qk_norm=True, seed=9),
}

SILU_CASES = {  # the stacked block's padding columns after A's (7 here) are never read
    "silu_one_block": dict(inter=128, tokens=70, slots=2, rank=8, seed=3),
    "silu_eight_slots": dict(inter=256, tokens=9, slots=8, rank=16, seed=4),
    "silu_one_slot_of_eight": dict(inter=128, tokens=70, slots=8, rank=16, seed=11, used=[5]),
}

CASES = {
    "qkv": dict(outs=[256, 128, 128], width_in=96, tokens=70, slots=4, rank=8, seed=0),
    "single": dict(outs=[128], width_in=64, tokens=5, slots=2, rank=16, seed=1),
    "one_slot": dict(outs=[128, 384], width_in=128, tokens=130, slots=1, rank=16, seed=2),
    # tiles whose tokens use few of the slots (their other slot columns skipped); a rank above the chunk
    "two_of_eight": dict(outs=[256, 128], width_in=64, tokens=70, slots=8, rank=16, seed=12, used=[-1, 3, 6]),
    "one_of_two_rank_32": dict(outs=[128], width_in=64, tokens=70, slots=2, rank=32, seed=13, used=[1]),
}


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_cases(__file__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_lora_kernel_equals_the_pytorch_path(measured, case):
    m = measured[case]
    assert m["err"] <= 1e-4 * max(1.0, m["scale"]), m
    assert m["split_err"] <= 1e-4 * max(1.0, m["scale"]), m
    assert m["by_slot_err"] <= 1e-4 * max(1.0, m["scale"]), m
    assert m["split_shape"] == [CASES[case]["tokens"], sum(CASES[case]["outs"])]
    assert m["base_untouched"], "a base-model token (slot -1) was changed"


@pytest.mark.parametrize("case", sorted(SILU_CASES))
def test_split_with_the_activation_equals_split_then_silu_mul(measured, case):
    m = measured[case]
    assert m["shape"] == [SILU_CASES[case]["tokens"], SILU_CASES[case]["inter"]]
    assert m["equal"], m  # the same products, sums and roundings in one kernel
    assert m["by_slot_equal"], m  # and with the tiles taking the tokens by slot


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_with_the_adapters_term_equals_split_then_rope(measured, case):
    m = measured[case]
    assert m["equal"] == [True, True, True], m  # q, and k and v as stored in the pools


def test_decoder_forward_with_stacked_adapters_equals_the_per_op_path(measured):
    m = measured["decoder"]
    assert m["silu_groups"] == [f"model.layers.{i}.mlp.gate_up_proj" for i in range(2)], m
    splits = [f"model.layers.{i}.{p}" for i in range(2) for p in ("mlp.down_proj", "self_attn.o_proj")]
    assert m["split_groups"] == splits, m
    assert m["rope_groups"] == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)], m
    # each layer's gate/up went through lora_split_silu, its o and down through split (then the residual
    # add and norm), its q/k/v's adapters' part to the RoPE kernel
    assert m["calls"] == {"silu": 2, "split": 4, "rope": 2}, m
    assert m["adapter_shows"] > 1e-2 and m["base_row_err"] < 1e-5, m
    assert m["err"] <= 1e-5 * max(1.0, m["scale"]), m


def test_slot_order_is_a_permutation_by_slot():
    import torch

    from miles.engine.triton_lora import slot_order

    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0, 0, 3])
    order = slot_order(slots, 4)
    assert sorted(order.tolist()) == list(range(len(slots)))  # each token once
    assert slots[order].tolist() == sorted(slots.tolist())  # the base model's first, then by slot
    assert slot_order(torch.tensor([], dtype=torch.int64), 2).shape == (0,)


def test_blocks_follow_members_and_unfit_shapes_fall_back():
    from miles.engine.triton_lora import fits, member_blocks

    assert member_blocks([256, 128, 128]).tolist() == [0, 0, 1, 2]
    assert member_blocks([200]) is None  # not a multiple of the block: PyTorch's path runs
    assert fits(16, 1, 64) and fits(8, 4, 64) and not fits(8, 1, 64) and not fits(16, 3, 64)


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """The interpreter runs the kernels' Python (and its bf16 dot is wrong); this runs Triton's compiler
    to sm_90 cubins in bf16 with the wrappers' launch options, so a construct only the compiler rejects
    shows, for one slot of rank 16 and for eight."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from miles.engine import triton_lora as k

    types = dict(h_ptr="*bf16", b_ptr="*bf16", base_ptr="*bf16", y_ptr="*bf16", slot_ptr="*i64", order_ptr="*i64",
                 scale_ptr="*fp32", member_ptr="*i32", x_ptr="*fp32", w_ptr="*bf16", eps="fp32")  # fmt: skip
    for fn, consts, options in (
        (k._lora_expand_kernel, dict(BT=k.BT, BN=k.BN, SORTED=True), dict(num_warps=8)),
        (k._lora_silu_kernel, dict(BT=k.SILU_BT, BN=k.SILU_BN, SORTED=True, LIBDEVICE=True), dict(num_warps=8, enable_fp_fusion=False)),
    ):  # fmt: skip
        for width in (16, 128):
            c = consts | {n: v for n, v in dict(R=16, SR=width, C=k.CHUNK).items() if n in fn.arg_names}
            sig = {n: "constexpr" if n in c else types.get(n, "i32") for n in fn.arg_names}
            attrs = {
                (fn.arg_names.index(n),): [["tt.divisibility", 16]]
                for n in fn.arg_names
                if n.endswith("_ptr")
            }
            kernel = compiler.compile(compiler.ASTSource(fn, sig, c, attrs), target=GPUTarget("cuda", 90, 32),
                                      options=options)  # fmt: skip
            assert kernel.asm["cubin"], f"{fn.__name__}: no cubin"


if __name__ == "__main__":
    for name, kwargs in CASES.items():
        print(json.dumps({name: _case(**kwargs)}), flush=True)
    for name, kwargs in SILU_CASES.items():
        print(json.dumps({name: _silu_case(**kwargs)}), flush=True)
    for name, kwargs in ROPE_CASES.items():
        print(json.dumps({name: _rope_case(**kwargs)}), flush=True)
    print(json.dumps({"decoder": _decoder_case(seed=5)}), flush=True)
