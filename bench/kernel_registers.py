"""Registers and spills of the engine's LoRA and MoE kernels built for a Hopper GPU, with no GPU needed:

    python -m bench.kernel_registers [--arch 90]

Triton compiles each kernel (miles/engine/triton_lora.py, and the RoPE kernel of
miles/engine/triton_fused.py with and without its LoRA term) for sm_<arch> with the launch options the
engine uses, at 0.5B shapes, for one slot of rank 16 (16 slot columns) and eight (128), and the MoE
expert GEMM (miles/engine/triton_moe.py) at each of its tiles; `cuobjdump
-res-usage`, shipped with Triton, reads each cubin. A kernel that spills (STACK > 0) keeps values in
local memory; more registers per thread mean fewer warps resident per SM. These are properties of the
build, not timings: `python -m bench.lora_gpu` times the kernels on a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path


def resources(fn, types: dict, consts: dict, options: dict, arch: int) -> dict:
    """{"registers": n, "stack": bytes} of `fn` compiled for sm_<arch> (pointer arguments 16-aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n.endswith("_ptr")}
    kernel = compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run(
            [str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
        )
    found = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {fn.__name__}: {out.stdout[-300:]}")
    return {"registers": int(found.group(1)), "stack": int(found.group(2))}


def rows(arch: int) -> list[dict]:
    from miles.engine import triton_fused as tf
    from miles.engine import triton_lora as tl

    bf16 = dict(h_ptr="*bf16", b_ptr="*bf16", base_ptr="*bf16", y_ptr="*bf16", w_ptr="*bf16", x_ptr="*fp32",
                slot_ptr="*i64", order_ptr="*i64", scale_ptr="*fp32", member_ptr="*i32", eps="fp32")  # fmt: skip
    rope = {
        n: "*bf16"
        for n in ("qkv_ptr", "q_ptr", "k_pool_ptr", "v_pool_ptr", "qn_ptr", "kn_ptr", "h_ptr", "b_ptr")
    }
    rope |= dict(cos_ptr="*fp32", sin_ptr="*fp32", slots_ptr="*i64", stride_ps="i64", eps="fp32",
                 lora_slot_ptr="*i64", scale_ptr="*fp32")  # fmt: skip
    exact = dict(enable_fp_fusion=False)
    # Qwen2.5-0.5B: 14 heads and 2 key/value heads of 64; the RoPE kernel's JB as rope_store_kv picks it
    shape = dict(H=14, KVH=2, D=64, H_PAD=16, KVH_PAD=2, HALF_PAD=32, QK_NORM=False)
    kernels = [
        ("lora_split / lora_add_ (expand)", tl._lora_expand_kernel, bf16, dict(BT=tl.BT, BN=tl.BN, C=tl.CHUNK, SORTED=True), dict(num_warps=8)),
        ("lora_split_silu", tl._lora_silu_kernel, bf16,
         dict(BT=tl.SILU_BT, BN=tl.SILU_BN, C=tl.CHUNK, SORTED=True, LIBDEVICE=True), dict(num_warps=8, **exact)),
        ("rope_store_kv with lora", tf._rope_store_kernel, rope, dict(shape, LORA=True, JB=8), dict(num_warps=4, **exact)),
    ]  # fmt: skip
    out = []
    for name, fn, types, consts, options in kernels:
        for width in (16, 128):
            wide = {n: v for n, v in dict(R=16, SR=width).items() if n in fn.arg_names}
            r = resources(fn, types, consts | wide, options, arch)
            out.append(dict(kernel=name, slot_columns=width, num_warps=options["num_warps"], **r))
    r = resources(
        tf._rope_store_kernel,
        rope,
        dict(shape, LORA=False, R=1, SR=1, JB=1),
        dict(num_warps=4, **exact),
        arch,
    )
    out.append(dict(kernel="rope_store_kv (no LoRA)", slot_columns=0, num_warps=4, **r))
    return out


def moe_rows(arch: int) -> list[dict]:
    """The fused MoE expert GEMM (miles/engine/triton_moe.py) at each tile of `tiles`, on the shapes of
    a Qwen3-30B-A3B layer (every dimension a multiple of the tiles: the mask-free loads); the decode
    attention (miles/engine/triton_attention.py) at head dim 128 with 4 and 8 warps; the row layout."""
    from miles.engine import triton_attention as attention
    from miles.engine import triton_moe as moe

    types = dict(a_ptr="*bf16", w_ptr="*bf16", c_ptr="*bf16", rows_ptr="*i32", block_expert_ptr="*i32",
                 used_ptr="*i32")  # fmt: skip
    out = []
    for rows_per_expert, when in ((2, "decode, 32 requests"), (16, "decode, 256 requests"), (100, "prefill")):
        cfg = moe.tiles(rows_per_expert)
        consts = dict(A_DIV=8, PRECISION="tf32", BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], EVEN=True)
        options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        r = resources(moe._expert_gemm_kernel, types, consts, options, arch)
        tile = f"BM {cfg['BM']}, BN {cfg['BN']}, BK {cfg['BK']}"
        out.append(dict(kernel=f"MoE expert GEMM, {when} ({tile})", num_warps=cfg["num_warps"], **r))
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", slots_ptr="*i64", pos_ptr="*i64", out_ptr="*fp32",
                 lse_ptr="*fp32", scale_log2="fp32")  # fmt: skip
    for g, d, model in ((8, 128, "the MoE bench's 32/4 heads of 128"), (7, 128, "7B: 28/4 heads of 128")):
        for warps in (4, 8):
            consts = dict(G=g, D=d, G_PAD=16, D_PAD=d, BLOCK_N=64, SPLIT=True, PRECISION="tf32")
            r = resources(attention._decode_kernel, types, consts, dict(num_warps=warps), arch)
            out.append(dict(kernel=f"decode attention, {model}", num_warps=warps, **r))
    types = dict(ids_ptr="*i64", rows_ptr="*i32", cursor_ptr="*i32", block_expert_ptr="*i32", used_ptr="*i32")
    consts = dict(E=128, EP=128, BM=32, CHUNK=128, FILL=1024)  # as `align` launches it for 128 experts
    r = resources(moe._count_kernel, types, consts, dict(num_warps=8), arch)
    out.append(dict(kernel="MoE row layout (_count_kernel), 128 experts", num_warps=8, **r))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="miles-triton-"))
    print("| kernel | slot columns | warps | registers / thread | spill stack (bytes) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows(args.arch):
        print(f"| {r['kernel']} | {r['slot_columns']} | {r['num_warps']} | {r['registers']} | {r['stack']} |")
    print()
    print("| kernel | warps | registers / thread | spill stack (bytes) |")
    print("|---|---:|---:|---:|")
    for r in moe_rows(args.arch):
        print(f"| {r['kernel']} | {r['num_warps']} | {r['registers']} | {r['stack']} |")


if __name__ == "__main__":
    main()
