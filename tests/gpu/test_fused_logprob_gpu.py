"""The fused log-prob + entropy kernels on a CUDA GPU against the plain torch path, at the trainer's
shapes: Qwen2.5's vocabulary (V = 151936), bf16 and fp32 logits [b, s, V] flattened, a quarter of
the positions not scored (prompt and padding), temperature 0.7; values, the gradient with log-probs
only and with the entropy in the loss, and time (the fused op must not be slower). Skipped without
CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels on device)"),
]

B, S, V = 4, 640, 151936


def _problem(dtype: torch.dtype, seed: int = 0):
    """(logits [B, S, V] like a trained model's, flat rows of 3/4 of the positions, targets, grads)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(B, S, V, device="cuda", generator=gen) * 2).to(dtype)
    logits[..., :64] += 12  # a few likely tokens, as after pre-training: entropy ~ 4 nats, not ~ log V
    rows = torch.randperm(B * S, device="cuda", generator=gen)[: B * S * 3 // 4]
    targets = torch.randint(0, V, (rows.numel(),), device="cuda", generator=gen)
    targets[::2] = torch.randint(0, 64, (rows.numel() // 2 + rows.numel() % 2,), device="cuda", generator=gen)
    g_logp = torch.randn(rows.numel(), device="cuda", generator=gen)
    g_ent = torch.randn(rows.numel(), device="cuda", generator=gen)
    return logits, rows, targets, g_logp, g_ent


def _run(fn, logits, rows, targets, g_logp, g_ent, entropy_grad: bool):
    x = logits.detach().clone().requires_grad_(True)
    logp, entropy = fn(x.view(-1, V), rows, targets, 0.7, True)
    loss = (g_logp * logp).sum() + ((g_ent * entropy).sum() if entropy_grad else 0.0)
    loss.backward()
    return logp.detach(), entropy.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_reference_at_full_vocab(dtype) -> None:
    from miles.train.losses import token_logprobs_entropy
    from miles.train.losses.fused_logprob import reference_logprobs_entropy

    problem = _problem(dtype)
    for entropy_grad in (False, True):
        got = _run(token_logprobs_entropy, *problem, entropy_grad)
        ref = _run(reference_logprobs_entropy, *problem, entropy_grad)
        assert got[2].dtype == dtype and got[2].shape == (B, S, V)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-4)
        # bf16: both sides round an fp32 gradient once, so they may differ by one ulp; fp32: the
        # log-sum-exp is summed in another order, ~1e-5 on the O(1) entries (measured 2.6e-5 at most)
        tol = dict(rtol=2**-7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[2], ref[2], **tol)
        scored = torch.zeros(B * S, dtype=torch.bool, device="cuda")
        scored[problem[1]] = True
        assert got[2].view(-1, V)[~scored].eq(0).all()


def test_fused_op_is_not_slower() -> None:
    from miles.train.losses import token_logprobs_entropy
    from miles.train.losses.fused_logprob import reference_logprobs_entropy

    problem = _problem(torch.bfloat16)

    def timed(fn) -> float:
        for _ in range(2):
            _run(fn, *problem, False)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            _run(fn, *problem, False)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 5

    fused, ref = timed(token_logprobs_entropy), timed(reference_logprobs_entropy)
    print(f"forward + backward, bf16 [{B * S}, {V}]: fused {fused:.2f} ms, reference {ref:.2f} ms")
    assert fused <= ref, (fused, ref)
