"""OpenAI's API on the real engine process, driven by the official `openai` client unchanged.

Chat (plain, streamed, n, stop, logprobs, max_completion_tokens), tool calls parsed from the output
(the output is fixed with the engine's `regex` extension so that the random tiny model emits a
`<tool_call>` block), completions (text, several prompts, token ids, streamed), `/v1/models`,
OpenAI's error body, and the token ids / meta_info a token-faithful caller reads, checked against
the native `/generate` answer for the same prompt.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

TIMEOUT_S = 120.0
"""Bound on one HTTP call (a hang, not a timing: the host is small and shared)."""
USER = [{"role": "user", "content": "what is the sum"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _regex(text: str) -> str:
    """A regex matching exactly `text` (written with escapes xgrammar's regex syntax reads)."""
    return "".join("\\" + c if c in '\\.^$*+?()[]{}|"' else ("\\n" if c == "\n" else c) for c in text)


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def _native(engine, input_ids: list[int], **params) -> dict:
    body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
    r = httpx.post(engine.url + "/generate", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    info = httpx.get(engine.url + "/model_info", timeout=TIMEOUT_S).json()
    assert models[0].id == info["model_path"]


def test_chat_is_the_native_generation_of_the_rendered_prompt(client, engine):
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True, "return_meta_info": True},
    )
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 6
    extra = choice.model_extra
    native = _native(engine, extra["prompt_token_ids"], max_new_tokens=6, temperature=0)
    assert extra["response_token_ids"] == native["output_ids"]
    assert choice.message.content == native["text"]
    assert r.usage.prompt_tokens == len(extra["prompt_token_ids"])
    meta = extra["meta_info"]
    assert meta["weight_version"] == native["meta_info"]["weight_version"]
    assert len(meta["miles_output_token_weight_versions"]) == 6
    assert [row[1] for row in meta["output_token_logprobs"]] == native["output_ids"]
    lps = [e.logprob for e in choice.logprobs.content]
    assert lps == pytest.approx([row[0] for row in native["meta_info"]["output_token_logprobs"]], abs=1e-4)


def test_chat_stream_matches_the_plain_answer(client, engine):
    kwargs = dict(model="tiny", messages=USER, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens
    with httpx.stream(
        "POST", engine.url + "/v1/chat/completions", json=kwargs | {"stream": True}, timeout=TIMEOUT_S
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert "usage" not in json.loads(lines[1][6:])  # only with stream_options.include_usage


def test_n_choices(client):
    r = client.chat.completions.create(model="tiny", messages=USER, n=2, max_tokens=4, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 8
    prompt = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1).usage.prompt_tokens
    assert r.usage.prompt_tokens == prompt  # the prompt counts once for all its samples
    again = client.chat.completions.create(model="tiny", messages=USER, n=2, max_tokens=4, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_stop_string_cuts_the_answer(client):
    forced = {"regex": _regex("one two three four")}
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=60, stop=[" three"], extra_body=forced
    )
    assert r.choices[0].message.content == "one two"
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == " three"


def test_top_logprobs(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy takes the most likely token
    # a token may hold part of a character: its bytes, joined, are the answer's UTF-8
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == r.choices[0].message.content


def test_max_completion_tokens_wins_over_max_tokens(client):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=9, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_tool_call_is_parsed(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200, extra_body={"regex": _regex(CALL_TEXT)}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}


def test_tool_call_streamed(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        max_tokens=200,
        stream=True,
        extra_body={"regex": _regex("Sure. " + CALL_TEXT)},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "Sure. "
    assert [(t.index, t.function.name) for t in calls] == [(0, "add")]
    assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_call_follows_a_tool_turn(client):
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert (
        r.usage.prompt_tokens
        > client.chat.completions.create(model="tiny", messages=USER, max_tokens=1).usage.prompt_tokens
    )


def test_named_tool_choice_constrains_the_output(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=12,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and text
    assert '<tool_call>\n{"name": "add", "arguments": {'.startswith(text)


def test_malformed_tool_call_is_content(client):
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        max_tokens=200,
        extra_body={"regex": _regex(bad), "return_meta_info": True},
    )
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.message.content == bad
    assert (
        choice.finish_reason == "stop" and choice.model_extra["meta_info"]["miles_malformed_tool_calls"] == 1
    )


def test_completions(client, engine):
    r = client.completions.create(model="tiny", prompt="the sum of", max_tokens=5, temperature=0, logprobs=2)
    (choice,) = r.choices
    assert (
        r.object == "text_completion" and choice.finish_reason == "length" and r.usage.completion_tokens == 5
    )
    assert len(choice.logprobs.tokens) == 5 and all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0 and "".join(choice.logprobs.tokens) == choice.text
    ids = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body={"return_token_ids": True}
    )
    assert ids.choices[0].model_extra["prompt_token_ids"] == [5, 6, 7]
    assert (
        ids.choices[0].model_extra["token_ids"]
        == _native(engine, [5, 6, 7], max_new_tokens=3, temperature=0)["output_ids"]
    )
    many = client.completions.create(model="tiny", prompt=["a b", "c d"], n=2, max_tokens=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and many.usage.completion_tokens == 8


def test_completions_stream(client):
    kwargs = dict(model="tiny", prompt="the sum of", max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body


def test_error_bodies(client):
    status, body = _error(
        lambda: client.chat.completions.create(model="tiny", messages=USER, extra_body={"frobnicate": 1})
    )
    assert status == 400 and set(body) == {"message", "type", "param", "code"}
    assert body["param"] == "frobnicate" and body["type"] == "invalid_request_error"
    status, body = _error(
        lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=10**6)
    )
    assert status == 400 and "context length" in body["message"]  # the native length check
    status, body = _error(
        lambda: client.chat.completions.create(
            model="tiny", messages=USER, stream=True, extra_body={"return_token_ids": True}
        )
    )
    assert status == 400 and body["param"] == "stream"
    status, body = _error(
        lambda: client.completions.create(model="tiny", prompt="x", extra_body={"regex": "("})
    )
    assert status == 400 and "regex" in body["message"]
    # the engine still serves afterwards
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1


def _open_stream(engine, rid: str) -> int:
    """Open a chat stream with `rid`, read its first event when it starts, leave: the status code."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 50, "stream": True, "rid": rid}
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            assert "Duplicate request ID detected" in r.json()["error"]["message"], r.text
            return r.status_code
        lines = r.iter_lines()  # held: a dropped line iterator closes the response, which leaves
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        assert _open_stream(engine, rid) == 400  # its rid is held while it runs
    return 200


def test_a_client_that_leaves_a_stream_aborts_its_request(engine):
    # paused in place, no request can finish by itself: only the abort of a stream that was left
    # can free its rid
    assert httpx.post(
        engine.url + "/pause_generation", json={"mode": "in_place"}, timeout=TIMEOUT_S
    ).is_success
    try:
        assert _open_stream(engine, "left") == 200
        deadline = time.monotonic() + TIMEOUT_S  # a bound on a hang, not a timing
        while _open_stream(engine, "left") != 200:
            assert time.monotonic() < deadline, "the left request still holds its rid"
            time.sleep(0.05)
    finally:
        httpx.post(engine.url + "/continue_generation", json={}, timeout=TIMEOUT_S)
