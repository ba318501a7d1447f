"""The batch-invariant operations of miles/quant/invariant.py on CUDA, as Triton kernels.

On a GPU the plain-PyTorch forms are correct but slow (a GEMM per block of 64 rows, attention and
sums as trees of elementwise launches). Here each operation is one kernel whose programs compute a
row, a tile or a query on their own, in an order fixed by compile-time constants alone:

- `linear`: a tiled GEMM with one fixed tile shape (BLOCK_M x BLOCK_N, K in steps of BLOCK_K, fp32
  accumulation). A token's row meets the same K order and the same instructions whatever the number
  of rows, which only changes how many tiles run; its result does not depend on the tile's other
  rows (each output element of a tensor-core MMA is its own dot product).
- `rms_norm`, `token_logprobs`: one program per row, the row's reductions in blocks whose size comes
  from the row length alone (hidden size, vocabulary), never from the number of rows.
- `attention`: one program per (query token, kv head) with the kv head's G query heads, keys read
  from a slot table in blocks of BLOCK_N keys from position 0 (online softmax in fp32), so a query
  meets the same blocks in a decode step, a prefill chunk, over a cached prefix and in a packed
  training row: every program holds the same heads of one token, never other tokens.

The engine (miles/engine/invariant_forward.py) and the FSDP trainer (miles/train/fsdp/true_on_policy.py)
both call these on CUDA tensors, so their log-probs agree bit for bit. The backward passes are not
invariant and need not be (only the forward's value must match the engine's): `linear` and
`stacked_linear` multiply the gradients with cuBLAS, `rms_norm` and `token_logprobs` have a row kernel
each (the latter from the forward's log Z), `attention` recomputes its forward with PyTorch's
variable-length flash attention under autograd. Triton's CPU interpreter
runs the kernels in the unit tests (fp32; its tl.dot of bf16 tiles is not the GPU's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

GEMM_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
"""The one GEMM configuration (never tuned per shape: a per-shape choice would break invariance)."""
KEY_BLOCK = 64
"""Keys per attention block."""
VOCAB_BLOCK = 4096
"""Logits per block of the log-softmax."""


@triton.jit(do_not_specialize=["M"])  # one build whatever the number of rows
def _gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n  # groups of GROUP_M row tiles sweep the columns together (L2 reuse)
    first_m = (pid // group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % rows_in_group
    pid_n = (pid % group) // rows_in_group
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        a = tl.load(
            x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0
        )
        b = tl.load(
            w_ptr + n[None, :] * stride_wn + k[:, None], mask=(n < N)[None, :] & (k < K)[:, None], other=0.0
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:  # added to the fp32 sums, one rounding to the output's dtype
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (m < M)[:, None] & (n < N)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) in x's dtype, fp32 accumulation; each row independent of M."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    tile = GEMM_TILE
    grid = (triton.cdiv(M, tile["BLOCK_M"]) * triton.cdiv(N, tile["BLOCK_N"]),)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # bf16 / fp16 tiles: tensor-core dots
    _gemm_kernel[grid](
        x, weight, weight if bias is None else bias, out, M, N, K, x.stride(0), weight.stride(0),
        out.stride(0), PRECISION=precision, HAS_BIAS=bias is not None, **tile,
    )  # fmt: skip
    return out


def _stack(weights: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """The weights stacked by rows in `dtype` (one weight: itself, no copy where it has the dtype)."""
    return weights[0].to(dtype) if len(weights) == 1 else torch.cat([w.to(dtype) for w in weights])


class _Linear(torch.autograd.Function):
    """x [M, K] times one weight, or several stacked by rows ([sum N_i, K]: q / k / v), as one GEMM;
    a stack is built again for the backward instead of being kept (the members stay referenced, as
    nn.Linear's are). A weight kept in another dtype computes in the input's."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, *weights)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return matmul(x, _stack(weights, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = grad @ _stack(weights, x.dtype) if ctx.needs_input_grad[0] else None
        grad_b = grad.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype and ctx.needs_input_grad[1] else None
        grad_ws = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            parts = (grad.t() @ x).split([w.shape[0] for w in weights])
            grad_ws = [g.to(w.dtype) for g, w in zip(parts, weights, strict=True)]
        return grad_x, grad_b, *grad_ws


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ bias), the rows through `matmul`; differentiable (cuBLAS backward)."""
    return stacked_linear(x, [weight], bias)


def stacked_linear(x: Tensor, weights: list[Tensor], bias: Tensor | None = None) -> Tensor:
    """x (W_0; W_1; ...)^T (+ bias): `linear` of the weights stacked by rows, without keeping the stack."""
    shape = x.shape
    out = _Linear.apply(x.reshape(-1, shape[-1]), bias, *weights)
    return out.view(*shape[:-1], out.shape[-1])


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    live = i < N
    x = tl.load(x_ptr + row * stride_x + i, mask=live, other=0.0)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    y = (h * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + i, mask=live, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, out.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _rms_norm_grad_kernel(
    x_ptr, w_ptr, g_ptr, dx_ptr, dw_ptr, N, stride_x, stride_g, stride_dx, eps, BLOCK: tl.constexpr
):  # fmt: skip
    """One row of the RMSNorm backward: dx = r (g w - x^ mean(g w x^)) with x^ = x r, r = rsqrt(mean(x^2)
    + eps) in fp32, and the row's share g * x^ (rounded as the forward rounds it) of the weight's
    gradient."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    live = i < N
    x = tl.load(x_ptr + row * stride_x + i, mask=live, other=0.0)
    h = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    xhat = h * r
    g = tl.load(g_ptr + row * stride_g + i, mask=live, other=0.0).to(tl.float32)
    gw = g * tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)
    dx = r * (gw - xhat * (tl.sum(gw * xhat, axis=0) / N))
    tl.store(dx_ptr + row * stride_dx + i, dx.to(dx_ptr.dtype.element_ty), mask=live)
    tl.store(dw_ptr + row * N + i, g * xhat.to(x_ptr.dtype.element_ty).to(tl.float32), mask=live)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        ctx.save_for_backward(rows, weight)
        ctx.eps = eps
        out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
        if rows.shape[0]:
            N = rows.shape[1]
            _rms_norm_kernel[(rows.shape[0],)](
                rows, weight, out, N, rows.stride(0), out.stride(0), eps, BLOCK=triton.next_power_of_2(N)
            )
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, weight = ctx.saved_tensors
        T, N = rows.shape
        g = grad.reshape(T, N)
        g = g if g.stride(-1) == 1 else g.contiguous()
        dx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        dw_rows = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        if T:
            _rms_norm_grad_kernel[(T,)](
                rows, weight, g, dx, dw_rows, N, rows.stride(0), g.stride(0), dx.stride(0), ctx.eps,
                BLOCK=triton.next_power_of_2(N),
            )  # fmt: skip
        dw = dw_rows.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(grad.shape), dw, None


def _recomputed_grads(fn, ctx, grad: Tensor, *args) -> tuple[Tensor | None, ...]:
    """Gradients of fn(*saved, *args) (PyTorch's ordinary operations) with respect to the saved
    inputs that need one (the Function's first inputs, in order)."""
    inputs = ctx.saved_tensors
    needs = ctx.needs_input_grad[: len(inputs)]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs, strict=True)]
        out = fn(*leaves, *args)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return tuple(next(grads) if t.requires_grad else None for t in leaves)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm, one program per row."""
    return _RMSNorm.apply(x, weight, eps)


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, req_ptr, pos_ptr, out_ptr,
    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tb, stride_ot, stride_oh,
    scale, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * G + g
    qd_mask = (g < G)[:, None] & (d < D)[None, :]
    last = tl.load(pos_ptr + t)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    q = q.to(tl.float32)
    slots = table_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_tb
    m_i = tl.full([G_PAD], -float("inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(0, last + 1, BLOCK_N):  # a padding query (position -1) runs none
        n = start + tl.arange(0, BLOCK_N)
        live = n <= last
        slot = tl.load(slots + n, mask=live, other=0).to(tl.int64)
        kv_mask = live[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + kvh * stride_kh + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
        s = tl.where(live[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kvh * stride_vh + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.maximum(l_i, 1e-30)[:, None]  # a padding query: 0
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=qd_mask,
    )


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, table: Tensor, req: Tensor, pos: Tensor, scale: float
) -> Tensor:
    """Each query token over its own request's keys 0..pos: q [T, H, D]; k, v [KVH, S, D] (a slot
    pool or a packed row's keys); table [R, L] the slot of each request's position; req [T] and pos
    [T] each query's request and position (-1: padding, output 0). Returns [T, H, D] in q's dtype."""
    T, H, D = q.shape
    KVH = k.shape[0]
    assert H % KVH == 0 and k.shape == v.shape and k.shape[2] == D, "q, k and v shapes disagree"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "the head dim must be contiguous"
    table = table if table.stride(1) == 1 else table.contiguous()
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    G = H // KVH
    d_pad = max(16, triton.next_power_of_2(D))
    _attention_kernel[(T, KVH)](
        q, k, v, table, req, pos, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0),
        out.stride(0), out.stride(1), scale,
        G=G, D=D, G_PAD=max(16, triton.next_power_of_2(G)), D_PAD=d_pad, BLOCK_N=KEY_BLOCK,
        # bf16 / fp16 inputs: TF32 tensor-core dots (their values are exact in TF32; the probabilities
        # round to TF32's 10-bit mantissa before P.V), fp32 inputs: IEEE dots
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=8 if d_pad >= 128 else 4,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class PackedRow:
    """The sequences packed one after another in a row of T = sum(lengths) tokens (sequence r's position
    p is token starts[r] + p), on the device: table [R, Lmax] each position's token, req [T] and pos [T]
    each token's sequence and position, bounds [R + 1] (int32) the sequences' offsets. Built once on the
    host and copied in one transfer, so the layers of a forward and its backward read no host values."""

    lengths: list[int]
    table: Tensor
    req: Tensor
    pos: Tensor
    bounds: Tensor

    @classmethod
    def of(cls, starts: list[int], lengths: list[int], device) -> PackedRow:
        width, count, total = max(lengths), len(lengths), sum(lengths)
        first = torch.tensor(starts, dtype=torch.int64)
        lens = torch.tensor(lengths, dtype=torch.int64)
        table = first[:, None] + torch.arange(width)[None, :]
        req = torch.repeat_interleave(torch.arange(count), lens, output_size=total)
        pos = torch.arange(total) - torch.repeat_interleave(first, lens, output_size=total)
        bounds = torch.cat((first, first[-1:] + lens[-1:]))
        flat = torch.cat((table.reshape(-1), req, pos, bounds)).to(device)  # the one host-to-device copy
        table, req, pos, bounds = flat.split([count * width, total, total, count + 1])
        return cls(list(lengths), table.view(count, width), req, pos, bounds.to(torch.int32))


def _causal_reference(q: Tensor, k: Tensor, v: Tensor, row: PackedRow, scale: float):
    """The packed row's attention by PyTorch's kernels (q [T, H, D], k / v [KVH, T, D]): on CUDA in bf16
    one variable-length flash launch for the row (miles/train/varlen_attention.py), else SDPA per
    sequence."""
    from miles.train.varlen_attention import packed_causal_attention

    return packed_causal_attention(
        q, k.transpose(0, 1), v.transpose(0, 1), row.bounds, max(row.lengths), scale
    )


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, row: PackedRow, scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.args = (row, scale)
        return paged_attention(q, k, v, row.table, row.req, row.pos, scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (*_recomputed_grads(_causal_reference, ctx, grad, *ctx.args), None, None)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, row: PackedRow, scale: float) -> Tensor:
    """Causal attention within each sequence of a packed row: q [T, H, D], k / v [KVH, T, D] ->
    [T, H, D]; differentiable (recomputed by PyTorch's kernels for the backward)."""
    return _PackedAttention.apply(q, k, v, row, scale)


@triton.jit
def _logprob_kernel(z_ptr, tok_ptr, temp_ptr, out_ptr, lse_ptr, V, stride_z, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    temp = tl.load(temp_ptr + row)
    i = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], -float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        z = tl.load(base + start + i, mask=start + i < V, other=-float("inf")).to(tl.float32) / temp
        top = tl.maximum(top, z)
    m = tl.max(top, axis=0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        z = tl.load(base + start + i, mask=start + i < V, other=-float("inf")).to(tl.float32) / temp
        total += tl.exp(z - m)
    lse = tl.log(tl.sum(total, axis=0))
    chosen = tl.load(base + tl.load(tok_ptr + row).to(tl.int64)).to(tl.float32) / temp
    tl.store(out_ptr + row, (chosen - m) - lse)
    tl.store(lse_ptr + row, m + lse)  # log Z of z / T, for the backward


@triton.jit
def _logprob_grad_kernel(
    z_ptr, rows_ptr, tok_ptr, temp_ptr, lse_ptr, grad_ptr, out_ptr, V, stride_z, stride_o,
    BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    """d logp / d z = (onehot(token) - softmax(z / T)) / T, times the incoming gradient, for the i-th
    log-prob: logits row rows[i] (or i), written to the same row of the gradient."""
    i_th = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i_th).to(tl.int64) if HAS_ROWS else i_th
    temp = tl.load(temp_ptr + i_th)
    log_z = tl.load(lse_ptr + i_th)
    scale = tl.load(grad_ptr + i_th) / temp
    token = tl.load(tok_ptr + i_th).to(tl.int64)
    i = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        col = start + i
        live = col < V
        z = tl.load(z_ptr + row * stride_z + col, mask=live, other=0.0).to(tl.float32) / temp
        g = (tl.where(col == token, 1.0, 0.0) - tl.exp(z - log_z)) * scale
        tl.store(out_ptr + row * stride_o + col, g.to(out_ptr.dtype.element_ty), mask=live)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: Tensor, rows: Tensor | None) -> Tensor:
        # fp32 whatever the caller holds: a kernel built for bf16 loads lays the row out otherwise and
        # sums it in another order (the engine passes fp32 logits, the trainer bf16: 1-2 ulp apart, seen)
        z = (logits if rows is None else logits.index_select(0, rows)).float().contiguous()
        N, V = z.shape
        out = torch.empty(N, dtype=torch.float32, device=z.device)
        log_z = torch.empty(N, dtype=torch.float32, device=z.device)
        if N:
            _logprob_kernel[(N,)](z, tokens, temperature, out, log_z, V, z.stride(0), BLOCK=VOCAB_BLOCK)
        ctx.save_for_backward(logits, tokens, temperature, log_z, rows)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, tokens, temperature, log_z, rows = ctx.saved_tensors
        z = logits if logits.stride(-1) == 1 else logits.contiguous()
        # rows not picked get no gradient; the picked ones are distinct (written, not added)
        out = torch.empty_like(z) if rows is None else torch.zeros_like(z)
        if tokens.shape[0]:
            _logprob_grad_kernel[(tokens.shape[0],)](
                z, tokens if rows is None else rows, tokens, temperature, log_z, grad.float().contiguous(),
                out, z.shape[1], z.stride(0), out.stride(0), BLOCK=VOCAB_BLOCK, HAS_ROWS=rows is not None,
            )  # fmt: skip
        return out, None, None, None


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float | Tensor = 1.0, rows: Tensor | None = None
) -> Tensor:
    """log softmax(logits / T)[token] per row in fp32: logits [N, V], tokens [n], T a float or [n]; rows
    [n] (distinct) the logits rows to score, all N by default. Differentiable with respect to logits."""
    n = tokens.shape[0]
    if isinstance(temperature, Tensor):
        temps = temperature.to(device=logits.device, dtype=torch.float32).expand(n).contiguous()
    else:
        temps = torch.full((n,), float(temperature), dtype=torch.float32, device=logits.device)
    return _TokenLogprobs.apply(logits, tokens.contiguous(), temps, rows)
