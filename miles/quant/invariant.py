"""Batch-invariant numerics: the operations of true on-policy training (`train.true_on_policy`).

The engine and the FSDP trainer compute the same policy, but a kernel's result for one token may
depend on what else is in the batch: a GEMM picks another kernel (and reduction order) for another
number of rows, a reduction over one row is split across threads when it is the only row, a CPU
vector loop runs its last elements through a scalar path whose exp() differs in the last bit. The
functions here give every token the same bits whatever the batch, chunk or cached prefix around it,
and the engine's forward and the trainer's forward both call them:

- `linear`: rows in blocks of exactly ROWS (the last one padded with zeros), one GEMM of the same
  shape per block, the bias added after. A token's row then meets the same kernel and reduction
  order in a decode step of 3 requests and in a training micro-batch of 2,000 tokens.
- `tree_sum`: a sum as a fixed binary tree of elementwise additions over the dimension padded with
  zeros to the next power of two. Elementwise additions are exact IEEE operations wherever they run,
  and zero padding past n leaves the tree of the first n values unchanged, so the sum of a prefix
  does not depend on how much padding follows it (decode pads a context to a multiple of 16,
  training to its sequence's length).
- `pointwise`: a transcendental function (exp, log, silu, cos, sin, rsqrt) applied so that every
  element takes the same code path: on the CPU single-threaded over a buffer padded to a multiple
  of 64 elements (all in the vector loop, no scalar tail); on CUDA as is (one device function).
- On top of them: `rms_norm` (transformers' formula), `rope_cos_sin` and `apply_rope` (the default
  RoPE, transformers' order of operations), `silu`, `attention` (each query over its own prefix:
  scores, softmax and the weighted sum of values as tree sums over the key axis, in fp32),
  `token_logprobs` (log-softmax of z / T at the chosen ids, in fp32), and a mixture-of-experts layer
  (`route`: softmax router and top-k; `experts`: each expert's rows through `linear`, a token's k
  outputs weighted and tree-summed in slot order, whichever tokens share its experts).

Everything else of the forward (embedding lookups, residual additions, products, maxima) is exact
elementwise work already. Gradients flow through every function (the trainer's backward needs no
invariance, only the forward's value).

On CUDA, `linear`, `stacked_linear`, `rms_norm` and `token_logprobs` run as Triton kernels of the same
contract (miles/quant/invariant_triton.py), and the engine and the trainer attend through its
`paged_attention` / `packed_attention`: the forms above cost a launch per block or tree level, which a
GPU pays in full. MILES_INVARIANT_GPU=torch keeps the forms above on CUDA too. Both sides of a
comparison run on one kind of device and one setting.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

ROWS = 64
"""Rows per GEMM block: every `linear` call multiplies [ROWS, in] blocks."""
_VECTOR = 64
"""Elements a CPU pointwise buffer is padded to a multiple of (two AVX-512 vectors of fp32)."""
_KEY_BLOCK_ELEMS = 1 << 22
"""Attention holds about this many fp32 products per block of queries."""


_threads_lock = threading.Lock()
_threads_saved: list[int] = []  # the setting before the outermost block, while blocks are open


@contextlib.contextmanager
def one_torch_thread():
    """Torch's intra-op threads set to 1 for the block, then put back (the setting is the process's:
    blocks open in several threads at once restore it when the last one closes)."""
    with _threads_lock:
        _threads_saved.append(torch.get_num_threads())
        torch.set_num_threads(1)
    try:
        yield
    finally:
        with _threads_lock:
            first = _threads_saved[0]
            _threads_saved.pop()
            if not _threads_saved:
                torch.set_num_threads(first)


def pointwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """`fn(x)` elementwise, each element's value independent of x's size and its place in x."""
    if x.is_cuda:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % _VECTOR
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    with one_torch_thread():  # a thread's share of the buffer would end in a scalar tail
        out = fn(flat)
    return out[:n].view(x.shape)


def tree_sum(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """The sum over `dim` as a binary tree of elementwise additions (module docstring)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    out = x[..., 0]
    return out.unsqueeze(dim) if keepdim else out


GPU_KERNELS = os.environ.get("MILES_INVARIANT_GPU", "triton")
"""On CUDA: "triton" (the default: miles/quant/invariant_triton.py) or "torch" (the forms above, as on
the CPU); each bit for bit on an H100 (tests/gpu, bench/RESULTS.md). The engine and the trainer must
use the same: the variable is read by both processes."""


def kernels_for(x: Tensor) -> bool:
    """Whether `x`'s operations run as the Triton kernels (a CUDA tensor, GPU_KERNELS "triton")."""
    return x.is_cuda and GPU_KERNELS == "triton"


def gpu_kernels():
    """miles/quant/invariant_triton.py (imported on first use: Triton comes with CUDA builds of torch)."""
    from miles.quant import invariant_triton

    return invariant_triton


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ bias) with every row computed by a GEMM of ROWS rows."""
    if kernels_for(x):
        return gpu_kernels().linear(x, weight, bias)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    m = rows.shape[0]
    pad = -m % ROWS
    if pad or m == 0:
        rows = torch.cat((rows, rows.new_zeros(pad or ROWS, rows.shape[1])))
    out = torch.cat([block @ weight.t() for block in rows.split(ROWS)])[:m]
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def stacked_bias(biases: list[Tensor | None], sizes: list[int], like: Tensor) -> Tensor | None:
    """The biases of weights stacked by rows, stacked the same way: zeros for a member without one,
    None where no member has one."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else like.new_zeros(n) for b, n in zip(biases, sizes, strict=True)])


def stacked_linear(
    x: Tensor, weights: Tensor | list[Tensor], bias: Tensor | None, sizes: list[int]
) -> list[Tensor]:
    """Projections of one input by several weights stacked by rows (q / k / v, gate / up) as one
    `linear`, split back into [..., sizes[i]]: one GEMM of one shape, whichever side computes it.
    `weights`: the stacked tensor (the engine's fused storage) or its members (the trainer's modules;
    on CUDA stacked inside the kernels' autograd function, so no stacked copy outlives the forward)."""
    if isinstance(weights, Tensor):
        out = linear(x, weights, bias)
    elif kernels_for(x):
        out = gpu_kernels().stacked_linear(x, weights, bias)
    else:
        out = linear(x, torch.cat(weights), bias)
    return list(out.split(sizes, dim=-1))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) computed in fp32, rounded to x's dtype before the weight
    multiplies (transformers' Qwen2RMSNorm / LlamaRMSNorm)."""
    if kernels_for(x):
        return gpu_kernels().rms_norm(x, weight, eps)
    h = x.float()
    var = tree_sum(h * h, keepdim=True) / h.shape[-1]
    h = h * pointwise(torch.rsqrt, var + eps)
    return weight * h.to(x.dtype)


def silu(x: Tensor) -> Tensor:
    return pointwise(F.silu, x)


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | str) -> Tensor:
    """The default RoPE's theta^(-2i/d), as transformers computes it (fp32)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / pointwise(lambda e: torch.pow(theta, e), exponent)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [..., head_dim] of `positions` (any shape), computed in fp32 and cast to `dtype`."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return pointwise(torch.cos, emb).to(dtype), pointwise(torch.sin, emb).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(x * cos) + (rotate_half(x) * sin): transformers' apply_rotary_pos_emb, term for term."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _attend_block(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """q [B, Qb, KVH, G, D], k / v [B, L, KVH, D] (fp32), visible [B, Qb, L] -> [B, Qb, KVH, G, D]."""
    kt = k.permute(0, 2, 1, 3)[:, None, :, None]  # [B, 1, KVH, 1, L, D]
    scores = tree_sum(q[:, :, :, :, None, :] * kt) * scale  # [B, Qb, KVH, G, L]
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).detach()
    p = pointwise(torch.exp, scores - top)
    total = tree_sum(p, keepdim=True)
    vt = v.permute(0, 2, 3, 1)[:, None, :, None]  # [B, 1, KVH, 1, D, L]
    return tree_sum(p[..., None, :] * vt) / total


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """Each query over its own prefix of keys: q [B, Q, H, D], k / v [B, L, KVH, D] (position j of
    request b's context at k[b, j]), q_pos [B, Q] the queries' positions (-1: padding, whose output
    is not to be used). Query (b, i) attends keys 0..q_pos[b, i]. Returns [B, Q, H, D] in q's dtype."""
    B, Q, H, D = q.shape
    L, KVH = k.shape[1], k.shape[2]
    per_query = max(1, H * L * D)  # products one query of one request holds
    if B > 1 and B * per_query > _KEY_BLOCK_ELEMS:  # requests in groups (all elementwise: same bits)
        rows = max(1, _KEY_BLOCK_ELEMS // per_query)
        return torch.cat([attention(q[b : b + rows], k[b : b + rows], v[b : b + rows], q_pos[b : b + rows], scale)
                          for b in range(0, B, rows)])  # fmt: skip
    qf = q.float().view(B, Q, KVH, H // KVH, D)
    kf, vf = k.float(), v.float()
    visible = torch.arange(L, device=q.device)[None, None, :] <= q_pos.clamp(min=0)[:, :, None]
    step = max(1, _KEY_BLOCK_ELEMS // (B * per_query))
    outs = [
        _attend_block(qf[:, i : i + step], kf, vf, visible[:, i : i + step], scale) for i in range(0, Q, step)
    ]
    return torch.cat(outs, dim=1).reshape(B, Q, H, D).to(q.dtype)


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float | Tensor = 1.0, rows: Tensor | None = None
) -> Tensor:
    """log softmax(logits / T)[token] per row (fp32): logits [N, V], tokens [n], T a float or [n]; rows
    [n] (distinct) the rows of logits to score, all N by default."""
    if kernels_for(logits):  # the rows picked inside the kernels: no gathered copy to scatter back
        return gpu_kernels().token_logprobs(logits, tokens, temperature, rows)
    z = (logits if rows is None else logits.index_select(0, rows)).float()
    if isinstance(temperature, Tensor):
        z = z / temperature.float()[:, None]
    elif temperature != 1.0:
        z = z / temperature
    outs = []
    for zb, tb in zip(z.split(ROWS), tokens.split(ROWS), strict=True):
        top = zb.amax(dim=-1, keepdim=True).detach()
        shifted = zb - top
        lse = pointwise(torch.log, tree_sum(pointwise(torch.exp, shifted)))
        outs.append(shifted.gather(1, tb[:, None].long())[:, 0] - lse)
    return torch.cat(outs) if outs else z.new_zeros(0)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """softmax in fp32: exp(x - max) over its tree sum."""
    x = x.float()
    e = pointwise(torch.exp, x - x.amax(dim=dim, keepdim=True).detach())
    return e / tree_sum(e, dim=dim, keepdim=True)


def normalize(weights: Tensor) -> Tensor:
    """Top-k weights divided by their (tree) sum over the last dimension."""
    return weights / tree_sum(weights, keepdim=True)


def route(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A softmax router (Qwen3-MoE) from its logits x W_gate^T [T, E] (`linear`): (probs [T, E] fp32,
    top-k weights [T, k] fp32, expert ids [T, k])."""
    probs = softmax(logits)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return probs, normalize(weights) if norm_topk_prob else weights, ids


def experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t) with e = ids[t, j], the k terms added as
    a tree in slot order: x [T, H], ids / weights [T, k], gate_up [E, 2I, H], down [E, H, I]."""
    T, k = ids.shape
    out = x.new_zeros(T, k, x.shape[-1])
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        gate, up = linear(x[t], gate_up[e]).chunk(2, dim=-1)
        out = out.index_put((t, j), linear(silu(gate) * up, down[e]))
    return tree_sum(out * weights.to(x.dtype)[..., None], dim=1)
