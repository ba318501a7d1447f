"""SGLang's sampling options on /generate against the real engine process: stop strings (trimmed, or
kept with no_stop_trim), stop_token_ids and ignore_eos, min_new_tokens, frequency / presence /
repetition penalties (checked against a greedy reference decode of the model with SGLang's formulas),
logit_bias, n > 1, and constrained decoding (regex, json_schema, ebnf); then a battery of malformed
fields, each a 400 naming the field, after which the engine still serves."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

PROMPT = [12, 40, 7, 99, 5, 230, 61, 18, 77, 150]
EOS = 2  # the tiny model's <|endoftext|> (miles/models/tiny.py)


def _post(engine, body: dict) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=120)


def _generate(engine, body: dict) -> dict | list:
    resp = _post(engine, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _greedy(engine, n: int = 12, **params) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, **params}
    return _generate(engine, {"input_ids": PROMPT, "sampling_params": sp})


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _reference(model, n: int, rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> list[int]:
    """Greedy decode of the model with SGLang's penalties over the output so far (no EOS stop)."""
    tokens, out = list(PROMPT), []
    with torch.no_grad():
        for _ in range(n):
            z = model(torch.tensor([tokens])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=z.shape[0]).float()
            seen = counts > 0
            z = torch.where(seen, torch.where(z < 0, z * rep, z / rep), z)
            z = z - freq * counts - pres * seen.float()
            out.append(int(z.argmax()))
            tokens.append(out[-1])
    return out


def test_greedy_matches_the_reference(engine, model):
    assert _greedy(engine, 24, ignore_eos=True)["output_ids"] == _reference(model, 24)


PENALTIES = [{"repetition_penalty": 1.05}, {"frequency_penalty": 0.02}, {"presence_penalty": 0.02}]
"""Small enough that the three formulas give three different decodes of this prompt (checked below)."""


@pytest.fixture(scope="module")
def penalty_decodes(model) -> list[list[int]]:
    """The reference decode under each of PENALTIES, then without any (computed once for the module)."""
    names = {"repetition_penalty": "rep", "frequency_penalty": "freq", "presence_penalty": "pres"}
    decodes = [_reference(model, 24, **{names[k]: v for k, v in p.items()}) for p in PENALTIES]
    return [*decodes, _reference(model, 24)]


@pytest.mark.parametrize("params", PENALTIES, ids=["repetition", "frequency", "presence"])
def test_penalties_follow_sglang_formulas(engine, penalty_decodes, params):
    decodes = penalty_decodes[: len(PENALTIES)]
    assert len({tuple(d) for d in penalty_decodes}) == 4, "each penalty must tell apart"
    assert _greedy(engine, 24, ignore_eos=True, **params)["output_ids"] == decodes[PENALTIES.index(params)]


def test_logit_bias_forces_a_token(engine):
    out = _generate(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "logit_bias": {"33": 100}},
        },
    )
    assert out["output_ids"] == [33] * 5


def test_stop_string_is_trimmed_or_kept(engine):
    full = _greedy(engine, 16, ignore_eos=True)
    text = full["text"]
    k = next(
        i
        for i in range(2, len(text) - 2)
        if text[i : i + 2].isascii() and text[i : i + 2].strip() == text[i : i + 2]
    )
    stop = text[k : k + 2]
    pos = text.find(stop)
    trimmed = _greedy(engine, 16, ignore_eos=True, stop=stop)
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == text[:pos]
    assert (
        len(trimmed["output_ids"]) < 16
        and full["output_ids"][: len(trimmed["output_ids"])] == trimmed["output_ids"]
    )
    kept = _greedy(engine, 16, ignore_eos=True, stop=[stop, "never-generated"], no_stop_trim=True)
    assert kept["text"] == text[: pos + len(stop)]


def test_stop_regex_stops_where_its_match_ends(engine):
    full = _greedy(engine, 16, ignore_eos=True)
    text = full["text"]
    k = next(i for i in range(2, len(text) - 2) if text[i : i + 2].isalnum())
    pattern = f"[{text[k]}]{re.escape(text[k + 1])}"
    by_string = _greedy(engine, 16, ignore_eos=True, stop=text[k : k + 2])
    by_regex = _greedy(engine, 16, ignore_eos=True, stop_regex=[pattern])
    assert by_regex["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert by_regex["output_ids"] == by_string["output_ids"]
    assert re.search(pattern, by_regex["text"])  # a pattern's text is not cut (it is not found literally)


def test_stop_token_ids_are_honoured_unless_ignore_eos(engine):
    full = _greedy(engine, 12, ignore_eos=True)["output_ids"]
    target = full[3]
    cut = full.index(target) + 1
    stopped = _greedy(engine, 12, stop_token_ids=[target])
    assert stopped["output_ids"] == full[:cut]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    ignored = _greedy(engine, 12, stop_token_ids=[target], ignore_eos=True)
    assert ignored["output_ids"] == full and ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_min_new_tokens_prevents_an_early_eos(engine):
    bias = {str(EOS): 100}
    early = _greedy(engine, 8, logit_bias=bias)
    assert early["output_ids"] == [EOS]
    late = _greedy(engine, 8, logit_bias=bias, min_new_tokens=4)
    assert len(late["output_ids"]) == 5 and late["output_ids"][-1] == EOS
    assert EOS not in late["output_ids"][:4]
    assert late["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


def test_n_gives_n_replies_sharing_the_prompt(engine):
    out = _generate(
        engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "n": 3}, "rid": "par"}
    )
    assert isinstance(out, list) and len(out) == 3
    assert len({r["meta_info"]["id"] for r in out}) == 3
    assert len({tuple(r["output_ids"]) for r in out}) > 1, "three samples at T=1 should not all agree"
    assert all(r["meta_info"]["cached_tokens"] >= len(PROMPT) - 1 for r in out)
    batch = _generate(
        engine,
        {"input_ids": [PROMPT, PROMPT[:5]], "sampling_params": {"max_new_tokens": 2, "n": 2}},
    )
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [10, 10, 5, 5]


def test_regex_constrains_the_output(engine):
    out = _generate(
        engine, {"text": "the sum is", "sampling_params": {"max_new_tokens": 10, "regex": "[0-9]{3}"}}
    )
    assert len(out["text"]) == 3 and out["text"].isdigit()
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_json_schema_and_ebnf_constrain_the_output(engine):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    sp = {"max_new_tokens": 60, "temperature": 0.8, "json_schema": json.dumps(schema)}
    body = {"text": "answer:", "sampling_params": sp}
    value = json.loads(_generate(engine, body)["text"])
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    sp = {"max_new_tokens": 10, "ebnf": 'root ::= "yes" | "no"'}
    assert _generate(engine, {"text": "answer:", "sampling_params": sp})["text"] in ("yes", "no")


BAD = [
    ({"sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
    ({"sampling_params": {"presence_penalty": -2.5}}, "presence_penalty"),
    ({"sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens"),
    ({"sampling_params": {"min_new_tokens": -1}}, "min_new_tokens"),
    ({"sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
    ({"sampling_params": {"n": 0}}, "n"),
    ({"sampling_params": {"n": "two"}}, "n"),
    ({"sampling_params": {"logit_bias": {"abc": 1.0}}}, "logit_bias"),
    ({"sampling_params": {"logit_bias": {"99999": 1.0}}}, "logit_bias"),
    ({"sampling_params": {"logit_bias": {"3": "high"}}}, "logit_bias"),
    ({"sampling_params": {"stop": ""}}, "stop"),
    ({"sampling_params": {"stop": [1, 2]}}, "stop"),
    ({"sampling_params": {"stop_token_ids": [99999]}}, "stop_token_ids"),
    ({"sampling_params": {"regex": "[0-9"}}, "regex"),
    ({"sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ({"sampling_params": {"ebnf": "root ::= "}}, "ebnf"),
    ({"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "regex"),
    ({"sampling_params": {"stop_regex": "(a"}}, "stop_regex"),
    ({"sampling_params": {"stop_regex": ["a"] * 40}}, "stop_regex"),
    ({"sampling_params": {"min_p": 0.1}}, "min_p"),
    ({"sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
    ({"return_logprob": True, "logprob_start_len": 11}, "logprob_start_len"),
    ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
    ({"return_logprob": True, "token_ids_logprob": [1, 99999]}, "token_ids_logprob"),
    ({"return_logprob": True, "token_ids_logprob": "1"}, "token_ids_logprob"),
    ({"return_logprob": True, "logprob_start_len": [0, 1]}, "logprob_start_len"),
    ({"return_text_in_logprobs": [True]}, "return_text_in_logprobs"),
]


def test_bad_fields_are_400s_naming_the_field_and_the_engine_serves_on(engine):
    for extra, name in BAD:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}} | extra
        resp = _post(engine, body)
        assert resp.status_code == 400, (extra, resp.text)
        assert name in resp.json()["error"]["message"], (extra, resp.text)
    assert len(_greedy(engine, 3, ignore_eos=True)["output_ids"]) == 3


def test_a_float_token_budget_is_the_integer_it_equals(engine):
    """SGLang's rule for an integral float budget: 1e9 is refused past the context exactly like 10**9,
    4.0 generates 4 tokens; a fractional one is a 400 (in BAD above)."""
    answers = [
        _post(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n}}) for n in (1e9, 10**9)
    ]
    assert [a.status_code for a in answers] == [400, 400], [a.text for a in answers]
    assert answers[0].json()["error"]["message"] == answers[1].json()["error"]["message"]
    assert "maximum context length" in answers[0].json()["error"]["message"]
    ok = _post(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4.0, "ignore_eos": True}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4
