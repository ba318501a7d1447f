"""`return_routed_experts` against a real engine process serving the tiny Qwen3-MoE model: SGLang's
wire format (base64 of int32 [prompt + completion - 1, num_hidden_layers, top_k], dense layers 0),
ids equal to transformers' router top-k for the same tokens, `routed_experts_start_len`, prefix-cache
hits, and the 400 of an engine started without `--enable-return-routed-experts`."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch

from miles.engine.process import start_engine

LAYERS, TOP_K = 2, 2  # the tiny MoE: layer 0 dense, layer 1 sparse (4 experts, top-2)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "tiny-moe", arch="qwen3_moe", seed=0))


@pytest.fixture(scope="module")
def engine(moe_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("routed") / "engine.log"
    proc = start_engine(moe_model, device="cpu", log_path=log, extra_args=["--enable-return-routed-experts"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hf_moe(moe_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()


def _generate(url: str, prompt: list[int], max_new: int, **extra) -> httpx.Response:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
        **extra,
    }
    return httpx.post(url + "/generate", json=body, timeout=120)


def _decode(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<i4").reshape(-1, LAYERS, TOP_K)


def _hf_routing(hf, tokens: list[int]) -> np.ndarray:
    """[len(tokens), num_layers, k] top-k of transformers' router (dense layer 0: zeros)."""
    with torch.no_grad():
        (logits,) = hf(torch.tensor([tokens]), output_router_logits=True).router_logits
    out = np.zeros((len(tokens), LAYERS, TOP_K), dtype=np.int32)
    out[:, 1] = torch.softmax(logits.float(), -1).topk(TOP_K, -1).indices.numpy()
    return out


def _routed(url: str, prompt: list[int], max_new: int, **extra) -> tuple[dict, np.ndarray]:
    r = _generate(url, prompt, max_new, return_routed_experts=True, **extra)
    assert r.status_code == 200, r.text
    out = r.json()
    return out, _decode(out["meta_info"]["routed_experts"])


def test_wire_format_and_ids_match_transformers(engine, hf_moe):
    prompt = [5, 17, 42, 99, 7, 250, 31, 8, 64]
    out, routed = _routed(engine.url, prompt, 6)
    tokens = prompt + out["output_ids"]
    assert routed.shape == (len(prompt) + 6 - 1, LAYERS, TOP_K)
    assert (routed[:, 0] == 0).all()  # the dense layer has rows, all 0
    assert np.array_equal(routed, _hf_routing(hf_moe, tokens[:-1]))
    assert ((routed[:, 1] >= 0) & (routed[:, 1] < 4)).all() and (routed[:, 1, 0] != routed[:, 1, 1]).all()


def test_start_len_returns_rows_from_that_position(engine):
    prompt = [9, 8, 7, 6, 5, 4, 3]
    _, full = _routed(engine.url, prompt, 4)
    _, tail = _routed(engine.url, prompt, 4, routed_experts_start_len=5)
    assert tail.shape == (len(prompt) + 4 - 1 - 5, LAYERS, TOP_K)
    assert np.array_equal(tail, full[5:])


def test_prefix_cache_hit_still_returns_full_routing(engine, hf_moe):
    """The prompt's K/V comes from the cache (computed by a request that did not ask for routing):
    the cached positions still have their rows."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    first = _generate(engine.url, prompt, 3)
    assert first.status_code == 200 and "routed_experts" not in first.json()["meta_info"]
    out, routed = _routed(engine.url, prompt, 5)
    assert out["meta_info"]["cached_tokens"] > 0
    assert np.array_equal(routed, _hf_routing(hf_moe, (prompt + out["output_ids"])[:-1]))


def test_request_without_the_engine_flag_is_a_400(moe_model, tmp_path):
    with start_engine(moe_model, device="cpu", log_path=tmp_path / "engine.log") as plain:
        r = _generate(plain.url, [1, 2, 3], 2, return_routed_experts=True)
        assert r.status_code == 400
        assert "--enable-return-routed-experts" in r.json()["error"]["message"]
        assert _generate(plain.url, [1, 2, 3], 2).status_code == 200


def test_negative_start_len_is_a_400(engine):
    r = _generate(engine.url, [1, 2, 3], 2, return_routed_experts=True, routed_experts_start_len=-1)
    assert r.status_code == 400 and "routed_experts_start_len" in r.json()["error"]["message"]


def test_parallel_samples_each_return_their_routing(engine, hf_moe):
    """n = 2: the prompt is prefilled once and both samples take it from the cache; each sample's
    rows are its own tokens' routing."""
    prompt = [40, 41, 42, 43, 44, 45]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True, "n": 2},
        "return_routed_experts": True,
    }
    r = httpx.post(engine.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for out in r.json():
        routed = _decode(out["meta_info"]["routed_experts"])
        assert np.array_equal(routed, _hf_routing(hf_moe, (prompt + out["output_ids"])[:-1]))


def test_stream_sends_routing_in_the_last_chunk_only(engine):
    prompt = [50, 51, 52, 53]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        "return_routed_experts": True,
        "stream": True,
    }
    chunks = []
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    # a fast engine may finish before the first chunk leaves (one chunk); routing comes only with the
    # finished request, never in a chunk of a running one
    assert chunks and chunks[-1]["meta_info"].get("finish_reason"), chunks
    running = [c for c in chunks if not c["meta_info"].get("finish_reason")]
    assert not any("routed_experts" in c["meta_info"] for c in running), running
    assert _decode(chunks[-1]["meta_info"]["routed_experts"]).shape == (len(prompt) + 5 - 1, LAYERS, TOP_K)
