"""Gumbel-max sampling on CUDA: the sampler's plain path (no top-p/top-k) in one pass over the logits.

Maths (the same as miles/engine/sampling.py, which is the reference): for a row with temperature
T > 0 the token is argmax_i (z_i / T + g_i), g_i = -log(-log u_i), where u_i is the Murmur3-finaliser
hash of (seed, step, i) mapped to (0, 1); for T = 0 it is argmax_i z_i. Its log-prob is
z_tok / T' - logsumexp_i (z_i / T') with T' = T, or 1 when greedy. A row is cut into splits (as many
as it takes to keep the GPU busy with few rows); one program per (row, split) streams its stretch of
logits once in blocks, keeping the running maximum of the score with its index and a running (max,
sum) for the log-sum-exp, and a second small kernel combines the splits' parts into the token and its
log-prob. Nothing of vocabulary size is written. The hash is computed in uint32 arithmetic, which
wraps modulo 2^32 exactly as the reference's int64-and-mask arithmetic. Ties go to the smallest
index, as torch.argmax; the log-prob equals the reference's up to the summation order.

Imported only where CUDA tensors are sampled (Triton is part of PyTorch's CUDA builds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel_partial_kernel(
    logits_ptr, stride, temp_ptr, seed_ptr, step_ptr, part_ptr, vocab, chunk, BLOCK: tl.constexpr
):
    """Program (row, split): best score and its index, and the (max, sum) of the log-sum-exp, over the
    split's stretch of the row; written as 4 fp32 values (the index as a float, exact below 2^24)."""
    row, split = tl.program_id(0), tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0.0
    div = tl.where(greedy, 1.0, temp)
    seed = tl.load(seed_ptr + row).to(tl.uint32)
    step = tl.load(step_ptr + row).to(tl.uint32)
    key = _fmix32(_fmix32(seed) ^ (step * 0x9E3779B1))
    base = logits_ptr + row.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    # per-lane running state; reduced across lanes once at the end
    best_val = tl.full([BLOCK], -float("inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    run_max = tl.full([BLOCK], -1e30, tl.float32)
    run_sum = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        valid = offs < hi
        z = tl.load(base + offs, mask=valid, other=-float("inf"))
        zs = z / div
        new_max = tl.maximum(run_max, zs)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(zs - new_max)
        run_max = new_max
        h = _fmix32(key ^ (offs.to(tl.uint32) * 0x27D4EB2F))
        u = ((h >> 8).to(tl.float32) + 0.5) / 16777216.0
        score = tl.where(greedy, z, zs - tl.log(-tl.log(u)))
        score = tl.where(valid, score, -float("inf"))
        take = score > best_val
        best_idx = tl.where(take, offs, best_idx)
        best_val = tl.where(take, score, best_val)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)
    part_max = tl.max(run_max, axis=0)
    part_sum = tl.sum(run_sum * tl.exp(run_max - part_max), axis=0)
    out = part_ptr + (row * tl.num_programs(1) + split) * 4
    tl.store(out, top)
    tl.store(out + 1, idx.to(tl.float32))
    tl.store(out + 2, part_max)
    tl.store(out + 3, part_sum)


@triton.jit
def _gumbel_combine_kernel(
    logits_ptr, stride, temp_ptr, part_ptr, tok_ptr, logp_ptr, vocab, SPLITS: tl.constexpr
):
    """Program row: the row's token (best score over the splits, ties to the smallest index) and its
    log-prob from the splits' log-sum-exp parts."""
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row)
    div = tl.where(temp <= 0.0, 1.0, temp)
    parts = part_ptr + row * SPLITS * 4 + tl.arange(0, SPLITS) * 4
    val = tl.load(parts)
    idx = tl.load(parts + 1).to(tl.int32)
    pmax = tl.load(parts + 2)
    psum = tl.load(parts + 3)
    top = tl.max(val, axis=0)
    tok = tl.min(tl.where(val == top, idx, vocab), axis=0)
    row_max = tl.max(pmax, axis=0)
    total = tl.sum(psum * tl.exp(pmax - row_max), axis=0)
    chosen = tl.load(logits_ptr + row.to(tl.int64) * stride + tok) / div
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, chosen - row_max - tl.log(total))


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] (int64) and log-probs [B] (fp32) of fp32 CUDA logits [B, V]; see the module docstring.

    A small batch leaves most multiprocessors idle with one program per row, so each row is cut into
    `splits` stretches (default: enough programs to fill the GPU about four times over) whose parts a
    second kernel combines."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    batch, vocab = logits.shape
    assert vocab < 1 << 24, "split parts carry token indices as fp32"
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logps = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if not batch:
        return tokens, logps
    if splits is None:
        splits = _default_splits(logits.device, batch)
    temperature = temperature.float().contiguous()
    seeds, steps = seeds.contiguous(), steps.contiguous()
    assert splits & (splits - 1) == 0, "splits must be a power of two"
    block = 1024
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    parts = torch.empty(batch, splits, 4, dtype=torch.float32, device=logits.device)
    _gumbel_partial_kernel[(batch, splits)](
        logits, logits.stride(0), temperature, seeds, steps, parts, vocab, chunk, BLOCK=block, num_warps=4
    )
    _gumbel_combine_kernel[(batch,)](
        logits, logits.stride(0), temperature, parts, tokens, logps, vocab, SPLITS=splits, num_warps=1
    )
    return tokens, logps


_SM_COUNT: dict[int, int] = {}


def _default_splits(device: torch.device, batch: int) -> int:
    """Power of two giving about 4 programs per multiprocessor, from 2 to 32 splits."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = -(-4 * _SM_COUNT[index] // batch)
    return min(32, 1 << max(1, (want - 1).bit_length()))
