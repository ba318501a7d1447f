"""Speculative decoding on CUDA (fp32, so that greedy ties cannot part the compared runs): the
embedded engine's scheduler with a STANDALONE draft (the target itself) and with NEXTN (an oracle
MTP layer, tests/unit/test_mtp_speculation.py) gives the plain engine's greedy tokens, and the drafts
that must be kept are kept: eager, with CUDA graphs (the verify's decode step of 4 requests' k + 1 = 4
rows each replayed from the graph of 16 rows, the draft's greedy chain from its own), with graphs of
8 rows at most (the verify eager, the chain still replayed), or in a scheduler of 4 running slots whose
captured steps `fit_verify_graphs` widens to the verify's 16 rows (as the engine process does)."""

from __future__ import annotations

import pytest
import torch
from mtp_oracle import oracle_mtp

from miles.engine import speculative
from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
from miles.engine.model import ModelSpec
from miles.engine.mtp import MtpSpeculator, load_mtp
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _decoder(path: str):
    return build_decoder(
        ModelSpec.from_dir(path), path, "cuda", torch.float32, "none", DEFAULT_FP8_MIN_TOKENS
    )


def _run(sched: Scheduler) -> list[Request]:
    prompts = [[3, 9, 17, 5], [3, 9, 17, 5, 40], [60, 61], [7] * 30]
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=24, temperature=0.0), i, frozenset())
            for i, p in enumerate(prompts)]  # fmt: skip
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    return reqs


@pytest.mark.parametrize("graphs", ["eager", "graphs", "small", "widened"])
@pytest.mark.parametrize("algorithm", ["STANDALONE", "NEXTN"])
def test_greedy_speculation_on_cuda_equals_plain_decoding(algorithm, graphs, tmp_path) -> None:
    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path / "m", seed=0, mtp=True)
    if algorithm == "NEXTN":
        oracle_mtp(path)
    path = str(path)
    plain = _run(Scheduler(_decoder(path), 8, 4096))
    running = {"small": 8, "widened": 4}.get(graphs, 16)
    sched = Scheduler(_decoder(path), running, 4096, cuda_graph=graphs != "eager")
    if algorithm == "NEXTN":
        sched.speculator = MtpSpeculator(sched, load_mtp(path, sched.decoder, sched.max_total_tokens + 1), 3)
    else:
        sched.speculator = speculative.Speculator(sched, _decoder(path), 3)
    if graphs == "widened":
        speculative.fit_verify_graphs(sched)
        assert sched.graph_max_bs == 4 and sched.graph_rows == 16
    spec = _run(sched)
    assert [r.output for r in spec] == [r.output for r in plain]
    proposed = sum(r.spec_draft_token_num for r in spec)
    assert proposed > 0 and sum(r.spec_accept_token_num for r in spec) == proposed
    captured = {rows for rows, _, _ in sched.graphs.graphs} if sched.graphs is not None else set()
    # 4 requests decode plainly in at most 4 rows: 16 rows are a verify's (8 at most in "small")
    assert (16 in captured) == (graphs in ("graphs", "widened"))
    spec_graphs = sched.speculator.chains if algorithm == "NEXTN" else sched.speculator.cache.graphs
    assert (spec_graphs is not None and len(spec_graphs.graphs) > 0) == (graphs != "eager")
