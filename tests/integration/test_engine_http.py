"""The engine as a real process over HTTP: SGLang field conformance, bad requests, batching, cache,
logprobs against HF, pause/continue around an update from disk."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from safetensors.torch import save_file

from miles.engine.model import load_weights
from miles.engine.process import start_engine
from miles.rollout.client import EngineError, SGLangClient


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("engine") / "engine.log")
    yield proc
    proc.stop()


def _post(engine, route, body, status=200):
    # generous: a 1000-token request takes ~60 s on 2 shared, busy cores (a bound on a hang, not a timing)
    resp = httpx.post(engine.url + route, json=body, timeout=300)
    assert resp.status_code == status, resp.text
    return (
        resp.json()
        if resp.content and resp.headers.get("content-type", "").startswith("application/json")
        else None
    )


def test_generate_reply_fields_match_sglang(engine):
    out = _post(
        engine,
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
            "rid": "abc",
        },
    )
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 4)
    assert isinstance(meta["cached_tokens"], int) and meta["weight_version"] == "default"
    rows = meta["output_token_logprobs"]
    assert len(rows) == 4 and all(
        len(r) == 3 and r[2] is None and r[1] == t for r, t in zip(rows, out["output_ids"], strict=True)
    )
    assert meta["miles_output_token_weight_versions"] == ["default"] * 4


def test_batch_and_text_inputs(engine):
    out = _post(
        engine, "/generate", {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 2}}
    )
    assert isinstance(out, list) and [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]
    out = _post(engine, "/generate", {"text": "the sum of", "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["completion_tokens"] == 2 and isinstance(out["text"], str)


def test_stop_token_ids_finish_with_stop(engine):
    first = _post(
        engine,
        "/generate",
        {"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    )
    stop = first["output_ids"][2]
    out = _post(
        engine,
        "/generate",
        {
            "input_ids": [9, 10, 11],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [stop]},
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"][-1] == stop and len(out["output_ids"]) == first["output_ids"].index(stop) + 1


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input_ids": [1, 10**6]}, "input_ids"),
        ({"input_ids": []}, "empty"),
        ({}, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "temprature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_generate_requests_get_400_with_message(engine, body, words):
    resp = httpx.post(engine.url + "/generate", json=body, timeout=30)
    assert resp.status_code == 400
    assert words in resp.json()["error"]["message"]


def test_bad_admin_requests_and_engine_still_serves(engine):
    assert httpx.post(engine.url + "/generate", content=b"{not json", timeout=10).status_code == 400
    assert (
        httpx.post(engine.url + "/pause_generation", json={"mode": "sideways"}, timeout=10).status_code == 400
    )
    assert (
        httpx.post(engine.url + "/get_weights_by_name", json={"name": "nope"}, timeout=10).status_code == 400
    )
    assert (
        httpx.post(
            engine.url + "/update_weights_from_disk", json={"model_path": "/no/such/dir"}, timeout=10
        ).status_code
        == 400
    )
    assert httpx.post(engine.url + "/update_weights_from_tensor", json={}, timeout=10).status_code == 400
    assert (
        httpx.post(
            engine.url + "/init_weights_update_group", json={"master_address": "x"}, timeout=10
        ).status_code
        == 400
    )
    assert httpx.get(engine.url + "/health_generate", timeout=30).status_code == 200
    assert engine.alive()


def test_fault_injection_route_exists_only_with_its_flag(engine):
    resp = httpx.post(engine.url + "/debug/inject_fault", json={"kind": "scheduler_death"}, timeout=10)
    assert resp.status_code == 404
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200


def test_info_routes(engine, tiny_model):
    info = httpx.get(engine.url + "/get_model_info").json()
    assert info["model_path"].endswith("tiny") and info["is_generation"] is True
    server = httpx.get(engine.url + "/get_server_info").json()
    assert server["max_running_requests"] == 64 and "internal_states" in server
    assert httpx.get(engine.url + "/get_weight_version").json() == {"weight_version": "default"}
    weights = _post(engine, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 5})
    assert weights == load_weights(tiny_model)["model.norm.weight"][:5].tolist()


@pytest.mark.slow
def test_concurrent_http_requests_equal_sequential(engine):
    rng = random.Random(5)
    work = [
        ([rng.randrange(4, 380) for _ in range(rng.randint(1, 50))], rng.randint(1, 30)) for _ in range(64)
    ]

    async def run(concurrent: bool):
        client = SGLangClient(engine.url)
        calls = [
            client.generate(p, {"max_new_tokens": m, "temperature": 0, "ignore_eos": True}) for p, m in work
        ]
        if concurrent:
            return await asyncio.gather(*calls)
        return [await c for c in calls]

    together = asyncio.run(run(True))
    httpx.post(engine.url + "/flush_cache")
    alone = asyncio.run(run(False))
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert [len(r.output_ids) for r in together] == [m for _, m in work]


def test_http_logprobs_match_hf(engine, tiny_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = [11, 22, 33, 44, 55]
    out = _post(
        engine,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": 16,
                "temperature": 1.0,
                "sampling_seed": 3,
                "ignore_eos": True,
            },
            "return_logprob": True,
        },
    )
    ids = out["output_ids"]
    with torch.no_grad():
        logp = hf(torch.tensor([prompt + ids])).logits[0].log_softmax(-1)
    ref = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)]
    got = [row[0] for row in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-4


def test_prefix_reuse_reports_cached_tokens(engine):
    httpx.post(engine.url + "/flush_cache")
    shared = list(range(40, 100))
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    a = _post(engine, "/generate", {"input_ids": shared + [1, 2], "sampling_params": params})
    b = _post(engine, "/generate", {"input_ids": shared + [3, 4], "sampling_params": params})
    assert a["meta_info"]["cached_tokens"] == 0 and b["meta_info"]["cached_tokens"] >= len(shared)
    httpx.post(engine.url + "/flush_cache")
    c = _post(engine, "/generate", {"input_ids": shared + [3, 4], "sampling_params": params})
    assert c["meta_info"]["cached_tokens"] == 0 and c["output_ids"] == b["output_ids"]


def test_abort_request_by_rid(engine):
    async def run():
        client = SGLangClient(engine.url)
        task = asyncio.create_task(
            client.generate([1, 2, 3], {"max_new_tokens": 1000, "ignore_eos": True}, rid="long")
        )
        await asyncio.sleep(0.3)
        await client.abort_request("long")
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(run()).finish_reason == "abort"


def test_pause_in_place_across_update_from_disk(engine, tiny_model, tmp_path):
    new = {k: (v * 1.5 if k.endswith("norm.weight") else v) for k, v in load_weights(tiny_model).items()}
    save_file(new, str(tmp_path / "model.safetensors"))
    prompt, params = [7, 8, 9], {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    before = _post(engine, "/generate", {"input_ids": prompt, "sampling_params": params})

    async def run():
        client = SGLangClient(engine.url)
        task = asyncio.create_task(client.generate(prompt, params))
        while (await client.get_server_info())["internal_states"][0]["num_running_reqs"] == 0:
            await asyncio.sleep(0.01)
        await client.pause_generation("in_place")
        await client.update_weights_from_disk(str(tmp_path), weight_version="7")
        await client.continue_generation()
        return await asyncio.wait_for(task, 300), await client.get_weight_version()

    result, version = asyncio.run(run())
    assert version == "7" and result.finish_reason == "length" and len(result.output_ids) == 1000
    assert result.weight_versions[0] == "default" and result.weight_versions[-1] == "7"
    after = _post(engine, "/generate", {"input_ids": prompt, "sampling_params": params})
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "7"
    with pytest.raises(EngineError, match="model_path"):
        asyncio.run(SGLangClient(engine.url).update_weights_from_disk("/no/such/dir"))
