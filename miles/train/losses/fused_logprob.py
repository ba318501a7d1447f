"""Log-probs and entropies of the sampled tokens, read from the selected rows of the logits.

For logits X [N, V] (bf16 or fp32), selected rows r_t, targets y_t and temperature T, in fp32:

    z      = X[r_t] / T
    lse    = log sum_v exp(z_v)
    logp_t = z_y - lse
    H_t    = lse - sum_v p_v z_v = lse - E_p[z],        p = softmax(z)

Backward, for upstream gradients g_t (of logp) and h_t (of H):

    d logp_t / d z_v = [v = y] - p_v
    d H_t    / d z_v = -p_v (z_v - E_p[z]),              E_p[z] = lse - H_t
    d L / d X[r_t, v] = (g_t ([v = y] - p_v) - h_t p_v (z_v - E_p[z])) / T

and zero on the rows no token selects. Each row may be selected at most once (the callers' rows are
distinct positions); a repeated row would keep only one token's gradient on CUDA.

On CUDA the op is two Triton kernels (triton_logprob.py): the forward streams every selected row
once (online log-sum-exp and the running sum of exp(z - m) z for the entropy) and keeps lse and
E_p[z] per token, 8 bytes a token; the backward reads each selected row again and writes the whole
gradient once, in the logits' dtype, zeros included. No [T, V] fp32 tensor is ever made. The entropy
costs no backward work unless it reaches the loss (entropy bonus): with only the metric, its
gradient is None and the entropy term is compiled out. Elsewhere (CPU) the plain torch reference
runs: index, float, log_softmax, gather, and entropy.py's formula.

Left out: vocabularies sharded over tensor-parallel ranks (both backends gather the full vocabulary).
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.train.losses.entropy import entropy_from_logits


def token_logprobs_entropy(
    logits: Tensor, rows: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(logp [T], entropy [T] or None), fp32, of logits [N, V] rows `rows` scoring `targets`.

    `rows` must be distinct; `logits` rows must be contiguous (a [b * s, V] view of [b, s, V] is).
    Both outputs carry gradients to `logits`; the Triton kernels run for CUDA tensors, the
    reference elsewhere.
    """
    if logits.is_cuda:
        return fused_logprobs_entropy(logits, rows, targets, temperature, with_entropy)
    return reference_logprobs_entropy(logits, rows, targets, temperature, with_entropy)


def reference_logprobs_entropy(
    logits: Tensor, rows: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The same op in plain torch (materialises the [T, V] fp32 logits)."""
    z = logits.index_select(0, rows).float()
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, entropy_from_logits(z) if with_entropy else None


def fused_logprobs_entropy(
    logits: Tensor,
    rows: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    block: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The same op with the Triton kernels (`block`: logits per block, None for the default)."""
    logp, entropy = _FusedLogprobEntropy.apply(logits, rows, targets, temperature, with_entropy, block)
    return logp, entropy


class _FusedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, targets, temperature, with_entropy, block):
        from miles.train.losses import triton_logprob as K

        block = block or K.BLOCK
        logp, lse, mean = K.forward(logits, rows, targets, temperature, with_entropy, block)
        ctx.save_for_backward(logits, rows, targets, lse, mean)
        ctx.temperature, ctx.block = temperature, block
        ctx.set_materialize_grads(False)
        return logp, None if mean is None else lse - mean

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        from miles.train.losses import triton_logprob as K

        logits, rows, targets, lse, mean = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
            return None, None, None, None, None, None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad = K.backward(
            logits, rows, targets, lse, mean, grad_logp, grad_entropy, ctx.temperature, ctx.block
        )
        return grad, None, None, None, None, None
