"""The FSDP trainer on DeepSeek-V3 and DeepSeek-V4 through transformers' classes, from a rollout of the
embedded engine (V3: the trainer's log-probs of the engine's tokens equal the engine's within 1e-5 in
fp32, and the engine's routes are replayed on every top-k layer) and from sequences of its own (V4:
each in a micro-batch of its own, since its compressors pool across a packed row)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.config import resolve
from miles.sample import Sample

TOL = 1e-5


@pytest.fixture(scope="module")
def process_group():
    from miles.cluster.distributed import teardown_distributed

    yield
    teardown_distributed()


def _backend(path, tmp_path, engine="embedded", **train):
    from miles.train import get_backend

    run_dir = tmp_path / "runs" / "ds"
    plan = resolve(
        {
            "model": {"path": str(path)},
            "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
            "train": {"device": "cpu", "steps": 4, "lr": 1e-2, **train},
            "engine": {"kind": engine},
        }
    )
    backend = get_backend("fsdp")()
    backend.setup(plan)
    return backend


def _engine_rollout(path, n: int = 4) -> list[Sample]:
    """Samples of the engine's sampled continuations (fp32), their log-probs and routes."""
    from miles.engine.model import Decoder, ModelSpec, load_weights
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    dec = Decoder(ModelSpec.from_dir(path), load_weights(path), "cpu", torch.float32)
    dec.record_routing = True
    sched = Scheduler(dec, 8, 2048)
    rng = np.random.default_rng(5)
    reqs = []
    for i in range(n):
        sp = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
        prompt = rng.integers(4, 300, int(rng.integers(5, 20))).tolist()
        reqs.append(Request(rid=str(i), prompt=prompt, params=sp, seed=i, stop_ids=frozenset()))
        reqs[-1].return_routed_experts = True
        sched.submit(reqs[-1])
    sched.run_until_idle()
    samples = []
    for i, r in enumerate(reqs):
        s = Sample(0, i, r.prompt, r.output, [1] * len(r.output), list(r.logprobs), reward=float(i % 2))
        s.routed_experts = r.routed_experts.reshape(len(s.tokens) - 1, -1).numpy().astype(np.uint8)
        samples.append(s)
    return samples


def test_v3_trains_on_the_engines_rollout_with_its_routes_replayed(tmp_path, process_group):
    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path / "v3", arch="deepseek_v3", seed=1)
    samples = _engine_rollout(path)
    backend = _backend(path, tmp_path, routing_replay="rollout")
    metrics = backend.train(samples)
    assert metrics["router_agreement"] == 1.0
    assert metrics["logprob_mismatch"] <= TOL
    before = {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}
    backend.train(samples)
    after = {n: t for bucket in backend.export_weights(1 << 20) for n, t in bucket}
    assert any(not torch.equal(before[n], after[n]) for n in before if "kv_b_proj" in n)
    assert any(not torch.equal(before[n], after[n]) for n in before if ".experts." in n)


def test_v4_trains_equal_length_sequences_as_rows(tmp_path, process_group):
    """DeepSeek-V4's compressors pool across a packed row, so its micro-batches stack sequences of one
    length as rows of a batch: the trainer's log-probs equal transformers' per sequence."""
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path / "v4", arch="deepseek_v4", seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    samples = []
    for i in range(6):  # two lengths: two micro-batches of three rows
        n = 20 if i % 2 else 27
        prompt, response = rng.integers(4, 300, n).tolist(), rng.integers(4, 300, 10).tolist()
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt + response])).logits[0], -1)
        own = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]
        samples.append(Sample(0, i, prompt, response, [1] * 10, own, reward=float(i % 2)))
    backend = _backend(path, tmp_path, max_tokens_per_microbatch=4096)
    assert backend._rows
    from miles.train.batching import plan_rank

    bins = plan_rank(samples, list(range(6)), 0, 1, 4096, equal_lengths=True).micro_batches
    assert sorted(len(b) for b in bins) == [3, 3]
    metrics = backend.train(samples)
    assert metrics["logprob_mismatch"] <= TOL  # packed into one row, the sequences would see each other
    assert "router_agreement" not in metrics
