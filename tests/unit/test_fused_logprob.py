"""Token log-probs and entropies from selected logit rows (miles/train/losses/fused_logprob.py).

The plain torch path (what CPU tensors run) against the naive formula in fp64 under autograd, values
and gradients; then the Triton kernels against that path. `@triton.jit` reads TRITON_INTERPRET when
it decorates a kernel, and the setting would leak into every other kernel of the process, so the
kernel cases run in a child interpreter started with TRITON_INTERPRET=1 (this file run as a script),
which prints one JSON line of measured errors per case. V = 1000 with blocks of 256 (the last block
is partial), logits a column slice of a wider tensor (row stride != V), bf16 and fp32, temperature
0.7 and 1; the gradient with only log-probs, with the entropy as a metric (detached: must not change
the gradient) and with the entropy in the loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from miles.train.losses import token_logprobs_entropy
from miles.train.losses.fused_logprob import reference_logprobs_entropy

N, V, BLOCK = 12, 1000, 256
ROWS = [0, 2, 3, 7, 8, 11]  # distinct, unordered below; rows 1, 4, 5, 6, 9, 10 get no token


def _problem(dtype: torch.dtype, seed: int = 0):
    """(logits [N, V] with row stride V + 24, rows, targets, upstream grads for logp and H)."""
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(N, V + 24, generator=gen) * 3).to(dtype)
    rows = torch.tensor(ROWS)[torch.randperm(len(ROWS), generator=gen)]
    targets = torch.randint(0, V, (len(ROWS),), generator=gen)
    targets[0] = V - 1  # in the partial last block
    g_logp, g_ent = torch.randn(len(ROWS), generator=gen), torch.randn(len(ROWS), generator=gen)
    return wide[:, :V], rows, targets, g_logp, g_ent


def _naive(logits: torch.Tensor, rows, targets, temperature: float):
    z = logits.double()[rows] / temperature
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
    entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    return logp, entropy


def _grads(fn, logits, rows, targets, temperature, g_logp, g_ent, mode: str):
    """(logp, entropy, d/dlogits) of fn; mode: "logp", "metric" (entropy detached) or "entropy"."""
    x = logits.detach().clone().requires_grad_(True)
    logp, entropy = fn(x, rows, targets, temperature)
    loss = (g_logp * logp).sum()
    if mode == "entropy":
        loss = loss + (g_ent * entropy).sum()
    loss.backward()
    return logp.detach(), entropy.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_matches_naive_formula(dtype, temperature) -> None:
    logits, rows, targets, g_logp, g_ent = _problem(dtype)
    for mode in ("logp", "entropy"):
        ref = _grads(
            lambda x, r, t, T: reference_logprobs_entropy(x, r, t, T, with_entropy=True),
            logits, rows, targets, temperature, g_logp, g_ent, mode,
        )  # fmt: skip
        naive = _grads(_naive, logits, rows, targets, temperature, g_logp.double(), g_ent.double(), mode)
        assert ref[0].dtype == ref[1].dtype == torch.float32 and ref[2].dtype == dtype
        torch.testing.assert_close(ref[0].double(), naive[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(ref[1].double(), naive[1], rtol=0, atol=2e-5)
        # the gradient is rounded to the logits' dtype once (bf16: 2^-8 relative)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(ref[2].double(), naive[2].to(dtype).double(), **tol)
        unselected = [r for r in range(N) if r not in ROWS]
        assert ref[2][unselected].eq(0).all()


def test_cpu_tensors_take_the_reference_path() -> None:
    logits, rows, targets, _, _ = _problem(torch.bfloat16)
    logp, entropy = token_logprobs_entropy(logits, rows, targets, 0.7, with_entropy=True)
    ref = reference_logprobs_entropy(logits, rows, targets, 0.7, with_entropy=True)
    assert torch.equal(logp, ref[0]) and torch.equal(entropy, ref[1])
    assert token_logprobs_entropy(logits, rows, targets, 0.7)[1] is None


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_megatron_response_head_scores_the_response_positions(packed: bool) -> None:
    """GPTModel's hidden states are [s, b, h]; response token j of a sample with prompt length P that
    starts at column o of its row is scored at position o + P + j - 1 (packed: the samples back to
    back in one row; padded: one right-padded row each, o = 0). The head picks exactly those
    positions, in the flat token order, and only they get gradients."""
    from miles.sample import Sample
    from miles.train.megatron.batch import pack, response_head, response_logprobs

    samples = [
        Sample(0, 0, [5, 6, 7], [8, 9], [1, 1], [0.0, 0.0]),
        Sample(0, 1, [5], [3, 4, 2], [1, 0, 1], [0.0] * 3),
    ]
    (mb,) = pack(samples, [1.0, -1.0], max_tokens=64, device=torch.device("cpu"), packed=packed)
    b, s = mb.tokens.shape
    assert (b, s) == ((1, 9) if packed else (2, 5))
    hidden = torch.randn(s, b, 8, requires_grad=True)
    weight = torch.randn(16, 8)

    def output_layer(x, weight, runtime_gather_output):  # ColumnParallelLinear's call signature
        return x @ weight.t(), None

    logits = response_head(hidden, output_layer, weight, None, mb)
    logp, entropy = response_logprobs(logits, mb, temperature=0.5, with_entropy=True)
    full = hidden.detach() @ weight.t()  # [s, b, V], every position
    expected, scored, offset = [], set(), 0
    for k, sample in enumerate(samples):
        row, p = (0 if packed else k), len(sample.prompt_ids)
        for j, tok in enumerate(sample.response_ids):
            expected.append(torch.log_softmax(full[offset + p + j - 1, row] / 0.5, -1)[tok])
            scored.add((offset + p + j - 1, row))
        offset += len(sample.tokens) if packed else 0
    torch.testing.assert_close(logp.detach(), torch.stack(expected))
    assert entropy.shape == logp.shape
    logp.sum().backward()
    for c in range(s):
        for row in range(b):
            assert hidden.grad[c, row].any() == ((c, row) in scored), (c, row)


def run_cases() -> list[dict]:
    """Kernel vs reference for every dtype x temperature x gradient mode (run under the interpreter)."""
    from miles.train.losses.fused_logprob import fused_logprobs_entropy

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for temperature in (1.0, 0.7):
            logits, rows, targets, g_logp, g_ent = _problem(dtype, seed=1)
            grads = {}
            for mode in ("logp", "metric", "entropy"):
                ref = _grads(
                    lambda x, r, t, T: reference_logprobs_entropy(x, r, t, T, True),
                    logits, rows, targets, temperature, g_logp, g_ent, mode,
                )  # fmt: skip
                got = _grads(
                    lambda x, r, t, T: fused_logprobs_entropy(x, r, t, T, True, block=BLOCK),
                    logits, rows, targets, temperature, g_logp, g_ent, mode,
                )  # fmt: skip
                grads[mode] = got[2]
                no_ent = fused_logprobs_entropy(logits, rows, targets, temperature, False, block=BLOCK)
                unselected = [r for r in range(N) if r not in ROWS]
                scale = float(ref[2].abs().max())
                out.append(
                    dict(
                        dtype=str(dtype),
                        temperature=temperature,
                        mode=mode,
                        grad_dtype=str(got[2].dtype),
                        grad_shape=list(got[2].shape),
                        err_logp=float((got[0] - ref[0]).abs().max()),
                        err_entropy=float((got[1] - ref[1]).abs().max()),
                        err_grad=float((got[2].double() - ref[2].double()).abs().max()) / scale,
                        zero_rows=bool(got[2][unselected].eq(0).all()),
                        metric_free=bool(torch.equal(grads[mode], grads["logp"])) or mode == "entropy",
                        no_entropy=no_ent[1] is None and bool(torch.equal(no_ent[0], got[0])),
                    )
                )
    return out


def test_kernels_match_reference_under_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 12, proc.stdout[-2000:]
    for r in rows:
        assert r["grad_dtype"] == r["dtype"] and r["grad_shape"] == [N, V], r
        assert r["zero_rows"] and r["no_entropy"] and r["metric_free"], r
        assert r["err_logp"] <= 2e-5 and r["err_entropy"] <= 2e-5, r
        # fp32: reassociated sums; bf16: one rounding of each side (the interpreter truncates)
        assert r["err_grad"] <= (1e-6 if r["dtype"] == "torch.float32" else 2**-7), r


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(dtype, tmp_path, monkeypatch) -> None:
    """The interpreter runs the kernels' Python; this runs Triton's compiler to an sm_90 cubin, so a
    construct only the compiler rejects shows."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile every time, cache in the test's dir
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from miles.train.losses.triton_logprob import _backward_kernel, _forward_kernel

    def build(fn, types: dict, consts: dict):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n == "stride"]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = compiler.ASTSource(fn, sig, consts, attrs)
        return compiler.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})

    fp32 = dict(lse_ptr="*fp32", mean_ptr="*fp32", temperature="fp32")
    forward = dict(fp32, logits_ptr=f"*{dtype}", rows_ptr="*i64", targets_ptr="*i64", logp_ptr="*fp32")
    backward = dict(fp32, logits_ptr=f"*{dtype}", grad_ptr=f"*{dtype}", slot_ptr="*i64")
    backward.update(targets_ptr="*i64", grad_logp_ptr="*fp32", grad_ent_ptr="*fp32")
    for entropy in (False, True):
        consts = dict(ENTROPY=entropy, BLOCK=2048)
        assert build(_forward_kernel, forward, consts).asm["cubin"], "no cubin"
        assert build(_backward_kernel, backward, consts).asm["cubin"], "no cubin"


if __name__ == "__main__":
    for row in run_cases():
        print(json.dumps(row))
