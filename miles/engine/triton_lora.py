"""One kernel per layer group for the LoRA adapters' term of the CUDA decoder (miles/engine/lora.py).

The bank's unmerged term of a group (a layer's fused q/k/v or gate/up, or one projection) is, for
token t of slot s_t with scale c_s (0 columns and no term for the base model, s_t = -1):

    y[t, n] += sum_j ((x[t] . A[m(n)][j]) * c_{s_t} * [j // r == s_t]) * B[n, m(n)][j]

where m(n) is the member (q, k or v; gate or up) output column n belongs to, A[m] its [S r, in] stacked
slots and B[n, m] its row of the [S r] columns of the member's slots. PyTorch runs it as three kernels
(the A GEMM over every member, the mask, the B GEMM-accumulate over the block-diagonal B). Here it is
one GEMM and one Triton kernel. The bank's A lives in rows stacked under the layer's weight
(`Decoder.widen`), so the layer's own cuBLAS GEMM yields [x W^T | h = x A^T] in one launch
(`lora_split`); where it does not (`lora_add_`), h is a GEMM of its own. Then one Triton kernel, whose
programs each take BT tokens and BN output columns of one member, masks and scales those tokens' h
columns of that member, multiplies them by the block's B columns (the zero blocks of the
block-diagonal B are never read), adds the base output and writes y (fp32 sums, one rounding). For
a gate/up group whose output feeds silu(gate) * up, `lora_split_silu` does the same for both members
of a column block and applies the activation in that kernel, with the roundings of `lora_split` then
`silu_mul` (miles/engine/triton_fused.py), so the group's output is never written. Grids depend on
shapes alone, so the kernels are captured in CUDA graphs; the tests run them on the CPU under Triton's
interpreter against the PyTorch path, and compile them for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BT, BN = 64, 128
"""Tiles of `_expand`: with 8 warps its fp32 accumulator stays in registers (4 spill)."""
CHUNK = 16
"""Slot columns a tensor-core product takes at a time: a tile multiplies only the chunks of slots one of
its tokens is on, so a bank's cost follows the adapters in use, not its size (a slot of rank >= 16 is
a chunk or more of its own). With several slots the tiles take the tokens in slot order (`slot_order`),
so that a tile of a batch mixing 8 adapters meets one or two of them, not all 8."""
SILU_BT, SILU_BN = 64, 64
"""Tiles of `lora_split_silu`: two accumulators, so half the columns of `_expand`'s; with 8 warps
Triton's sm_90 build keeps every value in registers (`python -m bench.kernel_registers`)."""


@triton.jit
def _tile_tokens(pid_t, T, order_ptr, BT: tl.constexpr, SORTED: tl.constexpr):
    """The tokens (rows) of tile `pid_t`: BT consecutive ones, or of the slot order (`slot_order`), and
    which are live (the last tile may pass T)."""
    i = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    live = i < T
    if SORTED:
        t = tl.load(order_ptr + i, mask=live, other=0).to(tl.int64)
    else:
        t = i
    return t, live


@triton.jit
def _token_slots(t, live, slot_ptr, scale_ptr):
    """Tokens t's slots (-1: the base model, or past the end) and their adapters' scales (0 for -1)."""
    slot = tl.load(slot_ptr + t, mask=live, other=-1)
    scale = tl.load(scale_ptr + tl.maximum(slot, 0), mask=live & (slot >= 0), other=0.0)
    return slot, scale


@triton.jit
def _in_chunk(slot, c0, R: tl.constexpr, C: tl.constexpr):
    """Whether any of the tile's tokens has its slot among slot columns [c0, c0 + C)."""
    return tl.max(((slot >= c0 // R) & (slot <= (c0 + C - 1) // R)).to(tl.int32), axis=0) > 0


@triton.jit
def _slot_columns(
    h_ptr, stride_h, t, live, slot, scale, col0, c0, R: tl.constexpr, C: tl.constexpr, low: tl.constexpr,
):  # fmt: skip
    """Tokens t's columns [col0 + c0, col0 + c0 + C) of h (a chunk of one member's slots): each token's
    own slot's columns times its adapter's scale, the other slots' zero (and a base-model token's all
    zero), in `low`, B's dtype, for the tensor-core product with B."""
    j = c0 + tl.arange(0, C)
    h = tl.load(h_ptr + t[:, None] * stride_h + (col0 + j)[None, :], mask=live[:, None], other=0.0)
    return tl.where((j[None, :] // R) == slot[:, None], h.to(tl.float32) * scale[:, None], 0.0).to(low)


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, base_ptr, y_ptr, slot_ptr, order_ptr, scale_ptr, member_ptr,
    T, stride_h, stride_b, stride_base, stride_y,
    R: tl.constexpr, SR: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    SORTED: tl.constexpr,
):  # fmt: skip
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    m = tl.load(member_ptr + pid_n)
    t, live = _tile_tokens(pid_t, T, order_ptr, BT, SORTED)
    slot, scale = _token_slots(t, live, slot_ptr, scale_ptr)
    n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    low = b_ptr.dtype.element_ty
    out = tl.zeros((BT, BN), dtype=tl.float32)
    for c0 in tl.static_range(0, SR, C):  # only the chunks of slots some token of the tile is on
        if _in_chunk(slot, c0, R, C):
            h = _slot_columns(h_ptr, stride_h, t, live, slot, scale, m * SR, c0, R, C, low)
            b = tl.load(b_ptr + n[None, :] * stride_b + (m * SR + c0 + tl.arange(0, C))[:, None])
            out = tl.dot(h, b, out)
    y = tl.load(base_ptr + t[:, None] * stride_base + n[None, :], mask=live[:, None], other=0.0)
    tl.store(
        y_ptr + t[:, None] * stride_y + n[None, :],
        (y.to(tl.float32) + out).to(y_ptr.dtype.element_ty),
        mask=live[:, None],
    )


@triton.jit
def _lora_silu_kernel(
    h_ptr, b_ptr, base_ptr, y_ptr, slot_ptr, order_ptr, scale_ptr,
    T, inter, stride_h, stride_b, stride_base, stride_y,
    R: tl.constexpr, SR: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    SORTED: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    t, live = _tile_tokens(pid_t, T, order_ptr, BT, SORTED)
    slot, scale = _token_slots(t, live, slot_ptr, scale_ptr)
    low = b_ptr.dtype.element_ty
    n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    tg = tl.zeros((BT, BN), dtype=tl.float32)
    tu = tl.zeros((BT, BN), dtype=tl.float32)
    for c0 in tl.static_range(0, SR, C):  # gate's slot columns, then up's (B's rows inter on)
        if _in_chunk(slot, c0, R, C):
            j = (c0 + tl.arange(0, C))[:, None]
            hg = _slot_columns(h_ptr, stride_h, t, live, slot, scale, 0, c0, R, C, low)
            tg = tl.dot(hg, tl.load(b_ptr + n[None, :] * stride_b + j), tg)
            hu = _slot_columns(h_ptr, stride_h, t, live, slot, scale, SR, c0, R, C, low)
            tu = tl.dot(hu, tl.load(b_ptr + (inter + n[None, :]) * stride_b + SR + j), tu)
    base = base_ptr + t[:, None] * stride_base + n[None, :]
    out_ty = y_ptr.dtype.element_ty
    # y of each member as `lora_split` writes it (one rounding), then silu(gate) * up as `silu_mul`
    g = (tl.load(base, mask=live[:, None], other=0.0).to(tl.float32) + tg).to(out_ty).to(tl.float32)
    u = (tl.load(base + inter, mask=live[:, None], other=0.0).to(tl.float32) + tu).to(out_ty).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    a = tl.math.div_rn(g, 1.0 + e).to(out_ty).to(tl.float32)
    tl.store(y_ptr + t[:, None] * stride_y + n[None, :], (a * u).to(out_ty), mask=live[:, None])


def member_blocks(outs: list[int], block: int = BN) -> torch.Tensor | None:
    """The member of each BN-column block of a group with these member output sizes (int32), or None
    when a member's size is not a multiple of the block (the PyTorch path then runs)."""
    if any(o % block for o in outs):
        return None
    return torch.tensor([k for k, o in enumerate(outs) for _ in range(o // block)], dtype=torch.int32)


def fits(rank: int, slots: int, width_in: int) -> bool:
    """Whether the kernel takes a bank of `slots` x `rank` over inputs of `width_in` (tensor-core tiles
    need 16 slot columns and a power of two)."""
    sr = rank * slots
    return sr >= 16 and sr & (sr - 1) == 0 and sr <= 256 and width_in >= 16


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    members: torch.Tensor,
    token_slots: torch.Tensor,
    scale: torch.Tensor,
    rank: int,
    width: int,
    order: torch.Tensor | None = None,
) -> None:
    """y [T, sum out] += the adapters' term of one group in place (module docstring): x [T, in], a
    [n width, in], b [sum out, n width] (block-diagonal over the n members; width = S r), members:
    member_blocks() on y's device, token_slots [T] (-1: base), scale [S] fp32; `order`: the tokens
    by slot (`slot_order`), which the tiles then take, or None: tiles of consecutive tokens."""
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    _expand(x2 @ a.t(), b, y2, y2, members, token_slots, scale, rank, width, order)


def lora_split(
    both: torch.Tensor,
    b: torch.Tensor,
    members: torch.Tensor,
    token_slots: torch.Tensor,
    scale: torch.Tensor,
    rank: int,
    width: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., sum out] from both [..., sum out + n width] = [x W^T | x A^T], the output of a GEMM over a
    weight with the group's A stacked under it: y = x W^T + the adapters' term (arguments as
    `lora_add_`), in a new contiguous tensor."""
    out = b.shape[0]
    both2 = both.view(-1, both.shape[-1])
    y = both.new_empty(both2.shape[0], out)
    _expand(both2[:, out:], b, both2[:, :out], y, members, token_slots, scale, rank, width, order)
    return y.view(*both.shape[:-1], out)


def lora_split_silu(
    both: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    scale: torch.Tensor,
    rank: int,
    width: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up [..., I] of a gate/up group from both [..., 2I + 2 width (+ padding)] = [x W^T | x A^T]:
    `lora_split` then `silu_mul` (miles/engine/triton_fused.py) in one kernel, with the same roundings,
    so the group's [..., 2I] output is never written; b [2I, 2 width] block-diagonal over gate and up,
    I a multiple of the block (`member_blocks`); `order` as `lora_add_`'s."""
    inter = b.shape[0] // 2
    assert b.shape[1] == 2 * width and inter % SILU_BN == 0 and both.shape[-1] >= 2 * inter + 2 * width
    both2 = both.view(-1, both.shape[-1])
    T = both2.shape[0]
    y = both.new_empty(T, inter)
    if T:
        grid = (triton.cdiv(T, SILU_BT), inter // SILU_BN)
        _lora_silu_kernel[grid](
            both2[:, 2 * inter :], b, both2, y, token_slots, token_slots if order is None else order, scale,
            T, inter, both2.stride(0), b.stride(0), both2.stride(0), y.stride(0), R=rank, SR=width,
            C=CHUNK, BT=SILU_BT, BN=SILU_BN, SORTED=order is not None, LIBDEVICE=both.is_cuda, num_warps=8,
            enable_fp_fusion=False,
        )  # fmt: skip
    return y.view(*both.shape[:-1], inter)


def _expand(h, b, base, y, members, token_slots, scale, rank: int, width: int, order=None) -> None:
    """y = base + ((h * mask) b^T) by member blocks (y may be base itself)."""
    T = h.shape[0]
    grid = (triton.cdiv(T, BT), members.numel())
    _lora_expand_kernel[grid](
        h, b, base, y, token_slots, token_slots if order is None else order, scale, members,
        T, h.stride(0), b.stride(0), base.stride(0), y.stride(0),
        R=rank, SR=width, C=CHUNK, BT=BT, BN=BN, SORTED=order is not None, num_warps=8,
    )  # fmt: skip


def slot_order(token_slots: torch.Tensor, slots: int) -> torch.Tensor:
    """The tokens' indices ordered by slot (the base model's first), for tiles that each meet few
    slots: a counting sort in tensor ops of static shapes with no host read, so a CUDA graph captures
    it (one per forward; the kernels of every layer then read it)."""
    key = token_slots + 1  # 0: the base model
    hits = (key[:, None] == torch.arange(slots + 1, device=key.device)[None, :]).to(torch.int32)
    counts = hits.sum(dim=0)
    ahead = hits.cumsum(dim=0) - hits  # tokens of the same slot before each one
    pos = (counts.cumsum(dim=0) - counts)[key] + ahead.gather(1, key[:, None]).squeeze(1)
    order = torch.empty_like(key)
    order[pos] = torch.arange(key.shape[0], device=key.device, dtype=key.dtype)
    return order
