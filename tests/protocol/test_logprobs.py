"""SGLang's logprob options on /generate against the real engine process: `logprob_start_len` with
`input_token_logprobs` (one row per prompt position from the start, the first without a log-prob),
`top_logprobs_num`, `token_ids_logprob`, `return_text_in_logprobs`, and `max_new_tokens: 0` scoring a
prompt (log-probs equal to a forward of the model, also when the prompt is in the prefix cache)."""

from __future__ import annotations

import httpx
import pytest
import torch

PROMPT = [12, 40, 7, 99, 5, 230, 61, 18, 77, 150]


def _generate(engine, body: dict) -> dict | list:
    resp = httpx.post(engine.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _prompt_logprobs(model, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from a plain forward of the model."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


@pytest.mark.parametrize("start", [0, 3, len(PROMPT) - 1, len(PROMPT), -1, None])
def test_input_token_logprobs_cover_the_prompt_from_the_start(engine, start):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    if start is not None:
        body["logprob_start_len"] = start
    meta = _generate(engine, body)["meta_info"]
    first = len(PROMPT) if start in (None, -1) else start
    rows = meta["input_token_logprobs"]
    assert [r[1] for r in rows] == PROMPT[first:]
    if rows:
        assert rows[0][0] is None
        assert all(isinstance(r[0], float) and r[0] <= 0 for r in rows[1:])
    assert len(meta["output_token_logprobs"]) == 2


def test_max_new_tokens_zero_scores_the_prompt(engine, model):
    expected = _prompt_logprobs(model, PROMPT)
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    for _ in range(2):  # the second time the prompt is in the prefix cache: still every position
        out = _generate(engine, body)
        assert out["output_ids"] == [] and out["text"] == ""
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 0
        assert meta["finish_reason"]["type"] == "length"
        assert meta["output_token_logprobs"] == []
        rows = meta["input_token_logprobs"]
        assert [r[1] for r in rows] == PROMPT and rows[0][0] is None
        got = [r[0] for r in rows[1:]]
        assert got == pytest.approx(expected, abs=1e-4)


def test_prefix_cache_does_not_skip_asked_positions(engine, model):
    expected = _prompt_logprobs(model, PROMPT)
    _generate(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    meta = _generate(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 4,
        },
    )["meta_info"]
    rows = meta["input_token_logprobs"]
    assert [r[1] for r in rows] == PROMPT[4:]
    assert [r[0] for r in rows[1:]] == pytest.approx(expected[4:], abs=1e-4)
    assert meta["cached_tokens"] <= 4


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_top_logprobs_are_sorted_and_agree_with_the_output(engine, temperature):
    meta = _generate(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 6, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 5,
        },
    )["meta_info"]
    out_rows, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(top) == len(out_rows) == 6
    for (lp, tok, _), rows in zip(out_rows, top, strict=True):
        values = [r[0] for r in rows]
        assert len(rows) == 5 and values == sorted(values, reverse=True)
        if temperature == 0:
            assert rows[0][1] == tok and rows[0][0] == pytest.approx(lp, abs=1e-5)
        by_id = {r[1]: r[0] for r in rows}
        if tok in by_id:
            assert by_id[tok] == pytest.approx(lp, abs=1e-5)
        else:
            assert lp <= values[-1] + 1e-5
    in_top = meta["input_top_logprobs"]
    assert len(in_top) == len(PROMPT) and in_top[0] is None
    for (lp, tok, _), rows in zip(meta["input_token_logprobs"][1:], in_top[1:], strict=True):
        values = [r[0] for r in rows]
        assert values == sorted(values, reverse=True) and lp <= values[0] + 1e-5
        assert {r[1]: r[0] for r in rows}.get(tok, lp) == pytest.approx(lp, abs=1e-5)


def test_token_ids_logprob_rows_follow_the_asked_ids(engine):
    greedy = {"max_new_tokens": 4, "temperature": 0}
    first = _generate(engine, {"input_ids": PROMPT, "sampling_params": greedy, "return_logprob": True})
    ids = [first["output_ids"][0], 3, PROMPT[2]]
    meta = _generate(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": greedy,
            "return_logprob": True,
            "logprob_start_len": 1,
            "token_ids_logprob": ids,
        },
    )["meta_info"]
    out_ids = meta["output_token_ids_logprobs"]
    assert len(out_ids) == 4 and all([r[1] for r in rows] == ids for rows in out_ids)
    assert out_ids[0][0][0] == pytest.approx(first["meta_info"]["output_token_logprobs"][0][0], abs=1e-5)
    in_ids = meta["input_token_ids_logprobs"]
    assert len(in_ids) == len(PROMPT) - 1 and in_ids[0] is None
    # position 2 of the prompt is PROMPT[2]: its asked row equals its input log-prob
    assert in_ids[1][2][0] == pytest.approx(meta["input_token_logprobs"][1][0], abs=1e-5)
    assert "output_top_logprobs" not in meta


def test_return_text_in_logprobs_fills_the_third_slot(engine, tokenizer):
    meta = _generate(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "logprob_start_len": 5,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    )["meta_info"]
    for rows in (meta["input_token_logprobs"], meta["output_token_logprobs"], *meta["output_top_logprobs"]):
        for _, tok, text in rows:
            assert text == tokenizer.decode([tok])
    plain = _generate(
        engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    )
    assert all(r[2] is None for r in plain["meta_info"]["output_token_logprobs"])


def test_batch_takes_one_logprob_start_per_prompt(engine):
    other = PROMPT[:6]
    out = _generate(
        engine,
        {
            "input_ids": [PROMPT, other],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": [2, 0],
            "top_logprobs_num": [0, 3],
        },
    )
    assert [r[1] for r in out[0]["meta_info"]["input_token_logprobs"]] == PROMPT[2:]
    assert "input_top_logprobs" not in out[0]["meta_info"]
    assert [r[1] for r in out[1]["meta_info"]["input_token_logprobs"]] == other
    assert len(out[1]["meta_info"]["input_top_logprobs"]) == len(other)
