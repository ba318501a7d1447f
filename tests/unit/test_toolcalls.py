"""Tool-call parsing per template family (miles/chat/toolcalls.py), its streaming form, family
detection from a model directory, and chat rendering with tools (miles/chat/render.py)."""

from __future__ import annotations

import json

import pytest

from miles.chat.openai_schema import ChatCompletionRequest, OpenAIError, parse_request
from miles.chat.render import ChatRenderer, template_messages
from miles.chat.toolcalls import ToolCallStream, detect_family, parse_tool_calls

QWEN_TWO_CALLS = (
    "Let me compute.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,"b":2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "echo", "arguments": {"text": "é \\"q\\""}}\n</tool_call>'
)


def _args(call: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "chatml"])
def test_hermes_blocks_become_tool_calls(family):
    parsed = parse_tool_calls(QWEN_TWO_CALLS, family)
    assert parsed.content == "Let me compute." and parsed.malformed == 0
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["add", "echo"]
    assert _args(parsed.tool_calls[0]) == {"a": 1, "b": 2}
    assert _args(parsed.tool_calls[1]) == {"text": 'é "q"'}
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_arguments_are_reserialised_json_strings():
    parsed = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"x":[1,2],"y":"é"}}</tool_call>', "qwen3"
    )
    # canonical json.dumps spacing, non-ASCII kept: not byte-equal to what the model wrote
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"x": [1, 2], "y": "é"}'
    assert parsed.content is None


def test_arguments_given_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 3}"}</tool_call>'
    assert _args(parse_tool_calls(text, "qwen2.5").tool_calls[0]) == {"x": 3}


def test_malformed_block_stays_content_and_is_counted():
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>'
    parsed = parse_tool_calls("Before " + bad, "qwen2.5")
    assert parsed.tool_calls == [] and parsed.malformed == 1
    assert parsed.content == "Before " + bad


def test_one_good_and_one_malformed_block():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text, "qwen3")
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a"]
    assert parsed.malformed == 1 and parsed.content == '<tool_call>{"arguments": {}}</tool_call>'


def test_unterminated_last_block_parses_when_its_json_is_whole():
    parsed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"q": 1}}', "qwen2.5")
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f"] and parsed.malformed == 0
    cut = parse_tool_calls('<tool_call>\n{"name": "f", "argu', "qwen2.5")
    assert cut.tool_calls == [] and cut.malformed == 1


def test_plain_text_has_no_calls():
    for family in ("qwen2.5", "llama3"):
        parsed = parse_tool_calls("The answer is 42.", family)
        assert parsed.content == "The answer is 42." and parsed.tool_calls == [] and parsed.malformed == 0


def test_llama3_json_calls():
    parsed = parse_tool_calls('{"name": "get", "parameters": {"city": "Paris"}}', "llama3")
    assert parsed.content is None and _args(parsed.tool_calls[0]) == {"city": "Paris"}
    several = parse_tool_calls(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": [1]}}', "llama3"
    )
    assert [c["function"]["name"] for c in several.tool_calls] == ["a", "b"]
    assert _args(several.tool_calls[1]) == {"k": [1]}


def test_llama3_malformed_json_is_content():
    text = '{"name": "get", "parameters": {"city": "Par'
    parsed = parse_tool_calls(text, "llama3")
    assert parsed.tool_calls == [] and parsed.malformed == 1 and parsed.content == text
    no_name = parse_tool_calls('{"city": "Paris"}', "llama3")
    assert no_name.tool_calls == [] and no_name.malformed == 1


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match="llama3"):
        parse_tool_calls("x", "gpt-9")


def _stream(text: str, family: str, step: int = 3):
    s = ToolCallStream(family)
    fed = "".join(s.feed(text[i : i + step]) for i in range(0, len(text), step))
    return fed, s.finish()


@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_holds_back_a_call_and_emits_content(step):
    fed, done = _stream(QWEN_TWO_CALLS, "qwen2.5", step)
    assert fed == "Let me compute.\n"  # nothing of a call block goes out as content
    assert done.content is None and [c["function"]["name"] for c in done.tool_calls] == ["add", "echo"]
    fed, done = _stream("plain <tool text", "qwen2.5", step)
    assert fed + (done.content or "") == "plain <tool text" and done.tool_calls == []
    fed, done = _stream('{"name": "f", "parameters": {}}', "llama3", step)
    assert fed == "" and done.tool_calls[0]["function"]["name"] == "f"
    fed, done = _stream("Hello {x}", "llama3", step)
    assert fed + (done.content or "") == "Hello {x}"


def test_stream_gives_back_a_malformed_block_as_content():
    fed, done = _stream("a <tool_call>{bad}</tool_call> b", "qwen3")
    assert fed == "a " and done.content == "<tool_call>{bad}</tool_call> b" and done.malformed == 1


def _model_dir(tmp_path, model_type: str, template: str):
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


def test_detect_family(tmp_path):
    chatml = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    assert detect_family(_model_dir(tmp_path / "a", "qwen2", chatml)) == "qwen2.5"
    assert detect_family(_model_dir(tmp_path / "b", "qwen3", chatml)) == "qwen3"
    assert detect_family(_model_dir(tmp_path / "c", "llama", chatml + "<think>")) == "qwen3"
    assert detect_family(_model_dir(tmp_path / "d", "llama", "<|start_header_id|>")) == "llama3"
    assert detect_family(_model_dir(tmp_path / "e", "mistral", chatml)) == "chatml"


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_render_passes_tools_and_parsed_arguments_to_the_template(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    req = parse_request(
        ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "1 2"}],
                },
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
            ],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        },
    )
    r = ChatRenderer(model)
    text = r.render_text(req.messages, req.tools)
    assert text.startswith("TOOLS:add;<|im_start|>user\nadd 1 2<|im_end|>")  # trim_blocks eats the newline
    assert '<tool_call>{"a": 1}</tool_call>' in text  # arguments as an object, not a quoted string
    assert text.endswith("<|im_start|>assistant\n")
    assert r.render_ids(req.messages, req.tools) == r.tokenizer.encode(text, add_special_tokens=False)


def test_template_messages_keep_non_json_arguments():
    msgs = template_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "oops"}}],
            }
        ]
    )
    assert msgs[0]["content"] == "" and msgs[0]["tool_calls"][0]["function"]["arguments"] == "oops"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "bogus": 1}, "bogus"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "a"}}, "audio"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(OpenAIError) as e:
        parse_request(ChatCompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"
