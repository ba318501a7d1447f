"""SGLang's request options on a CUDA engine process: logprob options, logit bias, penalties, n > 1,
constrained decoding (regex, JSON schema) and streaming, each checked for its result, and plain
requests served beside requests with options produce the tokens they produce alone (the options
do not leak into the captured decode graph). Skipped without CUDA.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 engine, CUDA graphs)"),
]

PROMPT = [12, 40, 7, 99, 5, 230, 61, 18, 77, 150]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from miles.engine.process import start_engine
    from miles.models.tiny import init_tiny

    root = tmp_path_factory.mktemp("protocol_gpu")
    sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8)
    model = init_tiny(root / "m", arch="qwen2", num_key_value_heads=2, **sizes)
    # fp32: a request's greedy tokens are compared alone and in a mixed batch, and bf16 GEMMs of other
    # batch shapes round differently enough to flip a near-tie of this random model's logits
    with start_engine(
        model, device="cuda", dtype="float32", log_path=root / "engine.log", max_running_requests=64
    ) as e:
        yield e


def _generate(engine, body: dict):
    r = httpx.post(engine.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_top_logprobs_agree_with_the_greedy_token(engine) -> None:
    a = _generate(engine, {"input_ids": PROMPT, "sampling_params": GREEDY})
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 5}
    meta = _generate(engine, body)["meta_info"]
    chosen, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert [t[1] for t in chosen] == a["output_ids"]
    for (lp, tok, _), row in zip(chosen, top, strict=True):
        assert len(row) == 5 and row[0][1] == tok and abs(row[0][0] - lp) < 1e-3
        assert [r[0] for r in row] == sorted((r[0] for r in row), reverse=True)


def test_max_new_tokens_zero_scores_the_prompt(engine) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    out = _generate(engine, {**body, "logprob_start_len": 0})
    rows = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and len(rows) == len(PROMPT) and rows[0][0] is None
    assert [r[1] for r in rows] == PROMPT and all(r[0] < 0 for r in rows[1:])


def test_logit_bias_and_penalties(engine) -> None:
    biased = {"max_new_tokens": 5, "logit_bias": {"33": 100}}
    assert _generate(engine, {"input_ids": PROMPT, "sampling_params": biased})["output_ids"] == [33] * 5
    # the CPU suite checks each penalty's formula; here: they run in the CUDA path and take effect
    plain = _generate(engine, {"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"]
    pen = {**GREEDY, "repetition_penalty": 2.0, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    out = _generate(engine, {"input_ids": PROMPT, "sampling_params": pen})["output_ids"]
    assert len(out) == len(plain) and len(set(out)) >= len(set(plain))
    assert out != plain or len(set(plain)) == len(plain)


def test_n_replies_share_the_prompt(engine) -> None:
    out = _generate(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 4}})
    assert len(out) == 4 and all(len(r["output_ids"]) == 4 for r in out)
    assert all(r["meta_info"]["cached_tokens"] >= len(PROMPT) - 1 for r in out[1:])


def test_constrained_decoding(engine) -> None:
    r = _generate(
        engine, {"text": "the sum is", "sampling_params": {"max_new_tokens": 10, "regex": "[0-9]{3}"}}
    )
    assert len(r["text"]) == 3 and r["text"].isdigit()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"text": "x", "sampling_params": {"max_new_tokens": 40, "json_schema": json.dumps(schema)}}
    assert isinstance(json.loads(_generate(engine, body)["text"])["n"], int)


def test_streaming_chunks_add_up_to_the_reply(engine) -> None:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY}
    whole = _generate(engine, body)
    chunks = []
    with httpx.stream("POST", engine.url + "/generate", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    assert chunks and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_plain_requests_unchanged_beside_requests_with_options(engine) -> None:
    plain = [{"input_ids": PROMPT[: 3 + i], "sampling_params": GREEDY} for i in range(8)]
    alone = [_generate(engine, b)["output_ids"] for b in plain]
    special = [{"input_ids": PROMPT, "sampling_params": {**GREEDY, "regex": "[a-z ]{10,30}"}}] * 2
    special += [
        {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 3}
    ] * 2
    special += [{"input_ids": PROMPT, "sampling_params": {**GREEDY, "frequency_penalty": 1.0}}] * 2
    with ThreadPoolExecutor(16) as pool:
        mixed = list(pool.map(lambda b: _generate(engine, b), plain + special))
    assert [m["output_ids"] for m in mixed[:8]] == alone
