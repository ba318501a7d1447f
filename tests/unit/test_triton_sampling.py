"""The Triton Gumbel-max sampler (miles/engine/triton_sampling.py) on CPU under Triton's interpreter,
against the torch reference of miles/engine/sampling.py: same tokens, log-probs equal up to the
summation order, for the one-pass kernel and for rows cut into splits (some of them empty), with
greedy rows whose maximum appears twice (the smaller index wins, as torch.argmax).

TRITON_INTERPRET is read when a kernel is decorated, so the cases run in a child interpreter
started with it (this file run as a script), which prints one JSON line per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it ships with PyTorch's CUDA builds)")

SPLITS = [1, 2, 4, 8]


def _cases() -> list[dict]:
    import torch

    from miles.engine.sampling import _sample_plain
    from miles.engine.triton_sampling import gumbel_argmax

    gen = torch.Generator().manual_seed(0)
    batch, vocab = 6, 5000
    logits = torch.randn(batch, vocab, generator=gen) * 3
    logits[0] = 0.0
    logits[0, [3000, 10]] = 5.0  # a tie under greedy sampling
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5, 0.0])
    seeds = torch.arange(batch) * 7919 - 5
    steps = torch.arange(batch) % 3
    ref_tok, ref_lp = _sample_plain(logits, temperature, seeds, steps)
    out = []
    for splits in SPLITS:
        tok, lp = gumbel_argmax(logits, temperature, seeds, steps, splits=splits)
        out.append(
            dict(
                splits=splits,
                tokens_equal=tok.tolist() == ref_tok.tolist(),
                tie_token=int(tok[0]),
                max_logp_diff=float((lp - ref_lp).abs().max()),
            )
        )
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["splits"]: r for r in rows}


@pytest.mark.parametrize("splits", SPLITS)
def test_sampler_matches_reference(results, splits):
    r = results[splits]
    assert r["tokens_equal"], r
    assert r["tie_token"] == 10
    assert r["max_logp_diff"] < 1e-4, r


if __name__ == "__main__":
    for case in _cases():
        print(json.dumps(case), flush=True)
