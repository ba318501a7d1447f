"""FSDP2 backend on real gloo ranks: 2 ranks train exactly like 1, and exported weights reproduce
the trainer's logits in a fresh Hugging Face model and in the embedded engine."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from safetensors.torch import save_file
from test_fsdp_ranks import probe_ids, reference_runs

pytestmark = pytest.mark.slow

TOL = 1e-5
WEIGHTS_TOL = 3e-5
"""Weights after the steps: two ranks sum the gradients in another order, and Adam's normalised step
carries the rounding gap into the weights (seen up to 1.07e-5 on a 2-core AVX2 machine, under 1e-5 on
others)."""


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    return reference_runs(tiny_model, str(tmp_path_factory.getbasetemp() / "fsdp_runs"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_ranks_match_one_rank(runs):
    one, two = runs["one"], runs["two"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["metrics"]) == len(two["metrics"]) == 4
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for key in m1.keys() - {"step_time_s"}:
            assert math.isclose(m1[key], m2[key], rel_tol=TOL, abs_tol=1e-6), (key, m1[key], m2[key])
    assert _max_diff(one["tensors"]["weights"], two["tensors"]["weights"]) <= WEIGHTS_TOL
    assert (one["tensors"]["logits"] - two["tensors"]["logits"]).abs().max() <= TOL


def test_training_moved_the_weights(runs, tiny_model):
    from miles.engine.model import load_weights

    start = load_weights(tiny_model)
    trained = runs["two"]["tensors"]["weights"]
    assert _max_diff(start, trained) > 1e-4
    lrs = [m["lr"] for m in runs["one"]["metrics"]]
    assert lrs == pytest.approx([2e-4 / 3, 2e-4 * 2 / 3, 2e-4, 2e-4])  # linear warmup over 3 steps
    assert all(m["tokens"] > 0 and m["grad_norm"] > 0 and m["kl"] >= 0 for m in runs["one"]["metrics"])


def test_export_buckets_respect_bound_and_cover_the_model(runs, tiny_model):
    from transformers import AutoModelForCausalLM

    bound = runs["bucket_bytes"]
    two = runs["two"]
    sizes, names = two["bucket_bytes"], two["bucket_names"]
    assert len(sizes) > 2
    for size, bucket in zip(sizes, names, strict=True):
        assert size <= bound or len(bucket) == 1, (size, bucket)
    flat = [n for bucket in names for n in bucket]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert sorted(flat) == sorted(hf.state_dict().keys())


def test_exported_weights_reproduce_trainer_logits_in_fresh_hf_model(runs, tiny_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        before = hf(torch.tensor([probe_ids()])).logits[0]
        hf.load_state_dict(runs["two"]["tensors"]["weights"], strict=True)
        after = hf(torch.tensor([probe_ids()])).logits[0]
    trainer = runs["two"]["tensors"]["logits"]
    assert (after - trainer).abs().max() <= TOL
    assert (before - trainer).abs().max() > 100 * TOL  # the comparison can tell the weights apart


def test_exported_buckets_loaded_into_engine_match_trainer(runs, tiny_model, tmp_path):
    from miles.engine.process import start_engine

    out = tmp_path / "update"
    out.mkdir()
    weights = runs["two"]["tensors"]["weights"]
    for k, bucket in enumerate(runs["two"]["bucket_names"]):
        save_file({n: weights[n].contiguous() for n in bucket}, str(out / f"bucket_{k:03d}.safetensors"))
    body = {
        "input_ids": probe_ids(),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    trainer_logp = runs["two"]["tensors"]["logits"][-1].log_softmax(-1)
    with start_engine(tiny_model, device="cpu", log_path=tmp_path / "engine.log") as engine:
        before = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
        reply = httpx.post(
            engine.url + "/update_weights_from_disk", json={"model_path": str(out)}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        gen = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
    token = gen["output_ids"][0]
    engine_logp = gen["meta_info"]["output_token_logprobs"][0][0]
    assert token == int(trainer_logp.argmax())
    assert abs(engine_logp - float(trainer_logp[token])) <= 1e-4
    # the initial weights are measurably different, so the comparison above checks the update
    assert abs(before["meta_info"]["output_token_logprobs"][0][0] - engine_logp) > 1e-3
