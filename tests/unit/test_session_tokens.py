"""Token-faithful sessions on real chat templates: append-only prompts per template family, the
Qwen3 think case, the ChatML boundary newline, Llama 3, re-serialised tool arguments, forks on edited
history, and the loss mask of a hand-checked episode.

Tokenizers are built offline: the tiny model's (ChatML) and small byte-level BPE tokenizers carrying
the special tokens and the published chat templates of Qwen2.5, Qwen3 and Llama 3
(tests/golden/templates, sources in SOURCES.md). "Engine replies" are token ids chosen by the test,
as an engine would return them (ending with the family's end-of-turn token).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.agentic.session import FAMILIES, ChatTemplate, Session, detect_family, same_reply, template_message
from miles.agentic.session_server import parse_reply
from miles.sample import Status

TEMPLATES = Path(__file__).parents[1] / "golden" / "templates"
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
LLAMA_PLAIN = ["<|python_tag|>"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]


def family_tokenizer(template: str, special: list[str], plain: list[str], eos: str, bos: str | None = None):
    """A small byte-level BPE tokenizer with a family's special tokens and its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from miles.models.tiny import _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(1000, 0), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos)
    fast.chat_template = (TEMPLATES / template).read_text()
    return fast


@pytest.fixture(scope="module")
def tokenizers():
    from miles.models.tiny import build_tokenizer

    return {
        "tiny": build_tokenizer(),
        "qwen2.5": family_tokenizer("qwen2.5.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
        "qwen3": family_tokenizer("qwen3.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
        "llama3": family_tokenizer(
            "llama3.jinja", LLAMA_SPECIAL, LLAMA_PLAIN, "<|eot_id|>", "<|begin_of_text|>"
        ),
    }


def reply_ids(template: ChatTemplate, text: str, closed: bool = True) -> list[int]:
    """The ids an engine would return for `text`: its tokens, then the end-of-turn token."""
    return template.encode(text) + ([template.turn_end_id] if closed else [])


def answer(session: Session, turn, text: str, version: int = 0, finish: str = "stop", tools: bool = True):
    """Record `text` as the engine's reply to `turn`; returns (output ids, assistant message)."""
    out = reply_ids(session.template, text, closed=finish == "stop")
    message = parse_reply(text, session.template.family, tools)
    session.record(turn, out, [-0.25] * len(out), [version] * len(out), message, finish)
    return out, message


def tool_call_text(family: str, expr: str) -> str:
    if family == "llama3":
        return json.dumps({"name": "calc", "parameters": {"expr": expr}})
    return "<tool_call>\n" + json.dumps({"name": "calc", "arguments": {"expr": expr}}) + "\n</tool_call>"


def episode(session: Session, family: str, tools=TOOLS):
    """A 4-call tool episode driven like an agent: user -> tool call -> tool result -> answer ->
    new user turn -> answer. Returns each call's prompt and output ids and the final history."""
    history = [
        {"role": "system", "content": "you are helpful"},
        {"role": "user", "content": "what is 12 plus 30"},
    ]
    think = "<think>\nadd the numbers\n</think>\n\n" if family == "qwen3" else ""
    texts = [
        think + tool_call_text(family, "12+30"),
        think + "the answer is 42",
        think + tool_call_text(family, "42*2"),
        think + "it is 84",
    ]
    calls = []
    for k, text in enumerate(texts):
        turn = session.plan([template_message(m) for m in history], tools)
        out, message = answer(session, turn, text, version=k)
        calls.append((turn.prompt_ids, out))
        history.append(message)
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            history.append({"role": "tool", "tool_call_id": call["id"], "content": "42" if k == 0 else "84"})
        elif k == 1:
            history.append({"role": "user", "content": "and times 2"})
    return calls, history


@pytest.mark.parametrize("name", ["tiny", "qwen2.5", "qwen3", "llama3"])
def test_prompts_are_append_only(tokenizers, name):
    tok = tokenizers[name]
    template = ChatTemplate(tok)
    session = Session("s", template)
    tools = None if name == "tiny" else TOOLS
    calls, _ = episode(session, template.family.name if name != "tiny" else "chatml", tools)
    for (prompt, out), (next_prompt, _) in zip(calls, calls[1:], strict=False):
        assert next_prompt[: len(prompt) + len(out)] == prompt + out  # turn k's ids prefix turn k+1's
    (sample,) = session.samples()
    last_prompt, last_out = calls[-1]
    assert sample.tokens == last_prompt + last_out
    # every engine reply sits in the sample verbatim, under mask 1
    for prompt, out in calls:
        start = len(prompt) - len(sample.prompt_ids)
        assert sample.response_ids[start : start + len(out)] == out
        assert sample.loss_mask[start : start + len(out)] == [1] * len(out)
    assert sum(sample.loss_mask) == sum(len(out) for _, out in calls)
    assert sample.metadata["turns"] == 4 and sample.metadata["tool_calls"] == 2


@pytest.mark.parametrize("name", ["tiny", "llama3"])
def test_prompt_equals_full_render_where_the_template_is_prefix_preserving(tokenizers, name):
    """ChatML and Llama 3 render plain history the same way each turn: the session's prompt then
    decodes to exactly the template's rendering of the whole history (no drift, no lost boundary)."""
    tok = tokenizers[name]
    session = Session("s", ChatTemplate(tok))
    history = [{"role": "user", "content": "what is 1 plus 2"}]
    for k, text in enumerate(["the answer 3", "first 3 then 12", "done"]):
        turn = session.plan(history)
        expected = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        assert tok.decode(turn.prompt_ids) == expected
        assert turn.prompt_ids == session.template.encode(expected)
        _, message = answer(session, turn, text, tools=False)
        history += [message, {"role": "user", "content": f"and then {k}"}]


@pytest.mark.parametrize("name", ["tiny", "qwen2.5", "qwen3", "llama3"])
def test_rendering_equals_apply_chat_template(tokenizers, name):
    tok = tokenizers[name]
    template = ChatTemplate(tok)
    session = Session("s", template)
    tools = None if name == "tiny" else TOOLS
    _, history = episode(session, template.family.name, tools)
    messages = [template_message(m) for m in history]
    for options in ({}, {"enable_thinking": False}):
        for gen in (True, False):
            expected = tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=gen, tokenize=False, **options
            )
            assert template.render(messages, tools, options, gen) == expected


def test_chatml_boundary_newline(tokenizers):
    """The engine stops at <|im_end|>; the newline after it comes first in the appended tokens."""
    tok = tokenizers["tiny"]
    template = ChatTemplate(tok)
    session = Session("s", template)
    history = [{"role": "user", "content": "count to 3"}]
    first = session.plan(history)
    out, message = answer(session, first, "1 2 3", tools=False)
    assert out[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    second = session.plan(history + [message, {"role": "user", "content": "again"}])
    assert tok.decode(second.appended_ids) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert second.prompt_ids == first.prompt_ids + out + second.appended_ids


def test_qwen3_keeps_the_recorded_think_block(tokenizers):
    """Qwen3's template drops earlier <think> blocks once a new user turn comes: the re-rendered
    history differs from what the model saw, while the session's prompt keeps the record."""
    tok = tokenizers["qwen3"]
    session = Session("s", ChatTemplate(tok))
    assert session.template.family.name == "qwen3"
    history = [{"role": "user", "content": "what is 2 plus 2"}]
    first = session.plan(history)
    out, message = answer(session, first, "<think>\n2 and 2 make 4\n</think>\n\nthe answer 4", tools=False)
    assert message == {"role": "assistant", "reasoning_content": "2 and 2 make 4", "content": "the answer 4"}
    history += [message, {"role": "user", "content": "and 3 plus 3"}]
    second = session.plan(history)
    rerendered = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert "2 and 2 make 4" not in rerendered  # the template's own rendering loses the thinking
    assert "2 and 2 make 4" in tok.decode(second.prompt_ids)
    assert second.prompt_ids[: len(first.prompt_ids) + len(out)] == first.prompt_ids + out
    assert (
        tok.decode(second.appended_ids)
        == "\n<|im_start|>user\nand 3 plus 3<|im_end|>\n<|im_start|>assistant\n"
    )
    # template options reach the appended generation prompt (thinking switched off: an empty block)
    off = session.plan(history, options={"enable_thinking": False})
    assert off.parent is None  # other template options: a prompt the model has not seen, a new root
    assert tok.decode(off.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # a client that sends the thinking back inside the content still matches the record
    history[1] = {"role": "assistant", "content": "<think>\n2 and 2 make 4\n</think>\n\nthe answer 4"}
    assert session.plan(history).prompt_ids == second.prompt_ids


def test_qwen3_tool_results_after_a_thinking_reply(tokenizers):
    tok = tokenizers["qwen3"]
    session = Session("s", ChatTemplate(tok))
    history = [{"role": "user", "content": "what is 12 plus 30"}]
    first = session.plan(history, TOOLS)
    out, message = answer(
        session, first, "<think>\nuse calc\n</think>\n\n" + tool_call_text("qwen3", "12+30")
    )
    call = message["tool_calls"][0]
    history += [message, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    second = session.plan([template_message(m) for m in history], TOOLS)
    text = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(second.appended_ids) == text
    assert second.prompt_ids[: len(first.prompt_ids) + len(out)] == first.prompt_ids + out


def test_llama3_boundary(tokenizers):
    """Llama 3 ends a turn with <|eot_id|> and starts the next header right after it."""
    tok = tokenizers["llama3"]
    session = Session("s", ChatTemplate(tok))
    assert session.template.family.name == "llama3"
    history = [{"role": "user", "content": "what is 12 plus 30"}]
    first = session.plan(history, TOOLS)
    assert tok.decode(first.prompt_ids[:1]) == "<|begin_of_text|>"
    out, message = answer(session, first, tool_call_text("llama3", "12+30"))
    assert message["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expr": "12+30"}'}
    history += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"}]
    second = session.plan([template_message(m) for m in history], TOOLS)
    # (the published template writes a string tool result with tojson, quotes included)
    text = '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    assert tok.decode(second.appended_ids) == text
    assert "<|begin_of_text|>" not in tok.decode(second.appended_ids)


def test_reserialised_tool_arguments_match_the_record(tokenizers):
    """Clients send tool-call arguments back re-serialised; the call still continues the record
    (one branch), while re-rendering them would change the tokens (the template writes them with
    its own spacing)."""
    tok = tokenizers["qwen2.5"]
    session = Session("s", ChatTemplate(tok))
    history = [{"role": "user", "content": "what is 12 plus 30"}]
    first = session.plan(history, TOOLS)
    engine_text = '<tool_call>\n{"name": "calc", "arguments": {"expr":"12+30"}}\n</tool_call>'
    out, message = answer(session, first, engine_text)
    call = message["tool_calls"][0]
    sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "other-id",
                "type": "function",
                "function": {"name": "calc", "arguments": '{"expr":"12+30"}'},
            }
        ],
    }
    assert same_reply(template_message(sent), message)
    history += [sent, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    messages = [template_message(m) for m in history]
    second = session.plan(messages, TOOLS)
    assert not second.forked and second.parent is session.tree.nodes[0]
    assert second.prompt_ids[: len(first.prompt_ids) + len(out)] == first.prompt_ids + out
    rerendered = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert engine_text not in rerendered  # what naive re-rendering would have trained on
    assert engine_text in tok.decode(second.prompt_ids)
    # different arguments are a different reply: the history then leaves the record
    sent_other = {
        **sent,
        "tool_calls": [
            {**sent["tool_calls"][0], "function": {"name": "calc", "arguments": '{"expr": "1+1"}'}}
        ],
    }
    assert not same_reply(template_message(sent_other), message)


def test_fork_on_edited_history(tokenizers):
    tok = tokenizers["tiny"]
    session = Session("s", ChatTemplate(tok))
    history = [{"role": "user", "content": "what is 1 plus 2"}]
    t1 = session.plan(history)
    out1, m1 = answer(session, t1, "the answer 3", version=1, tools=False)
    history += [m1, {"role": "user", "content": "times 4"}]
    t2 = session.plan(history)
    out2, m2 = answer(session, t2, "the answer 12", version=2, tools=False)
    before = session.tree.nodes[1].token_ids()

    # the client rewrites its second question: the call continues the first reply as a new branch
    edited = history[:2] + [{"role": "user", "content": "times 5"}]
    t3 = session.plan(edited)
    assert t3.forked and t3.parent is session.tree.nodes[0]
    out3, _ = answer(session, t3, "the answer 15", version=3, tools=False)
    # the client rewrites the model's own first reply: that reply becomes context (mask 0)
    rewritten = [
        history[0],
        {"role": "assistant", "content": "it is three"},
        {"role": "user", "content": "times 4"},
    ]
    t4 = session.plan(rewritten)
    assert t4.forked and t4.parent is None
    answer(session, t4, "12", version=4, tools=False)

    assert session.tree.nodes[1].token_ids() == before  # nothing recorded was touched
    samples = session.samples()
    assert [s.metadata["node_ids"] for s in samples] == [[0, 1], [0, 2], [3]]
    assert session.forks == 2
    a, b, c = samples
    assert a.prompt_ids == b.prompt_ids == t1.prompt_ids  # the fork shares the first call
    assert a.response_ids[: len(out1)] == b.response_ids[: len(out1)] == out1
    assert b.tokens == t3.prompt_ids + out3
    assert "it is three" in tok.decode(c.prompt_ids) and sum(c.loss_mask) == len(c.response_ids)


def test_loss_mask_of_a_hand_checked_episode(tokenizers):
    """user -> reply (version 3) -> tool result -> reply cut by length (version 4) -> user -> reply."""
    tok = tokenizers["tiny"]
    session = Session("s", ChatTemplate(tok), {"group_id": 7})
    history = [{"role": "user", "content": "add 1 and 2"}]
    t1 = session.plan(history)
    out1, m1 = answer(session, t1, "call add", version=3, tools=False)
    history += [m1, {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    t2 = session.plan(history)
    out2, m2 = answer(session, t2, "the sum is", version=4, finish="length", tools=False)
    history += [m2, {"role": "user", "content": "go on"}]
    t3 = session.plan(history)
    out3, _ = answer(session, t3, "3", version=4, tools=False)

    (s,) = session.samples()
    dec = tok.decode
    assert dec(s.prompt_ids) == "<|im_start|>user\nadd 1 and 2<|im_end|>\n<|im_start|>assistant\n"
    spans = [(out1, 1), (t2.appended_ids, 0), (out2, 1), (t3.appended_ids, 0), (out3, 1)]
    assert [dec(ids) for ids, _ in spans] == [
        "call add<|im_end|>",
        "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n",
        "the sum is",  # cut by length: no end-of-turn token recorded ...
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n",  # ... so it is appended
        "3<|im_end|>",
    ]
    assert s.response_ids == [t for ids, _ in spans for t in ids]
    assert s.loss_mask == [m for ids, m in spans for _ in ids]
    assert s.rollout_logprobs == [-0.25 if m else 0.0 for ids, m in spans for _ in ids]
    versions = (
        [3] * len(out1) + [3] * len(t2.appended_ids) + [4] * (len(out2) + len(t3.appended_ids) + len(out3))
    )
    assert s.weight_versions == versions and s.oldest_version == 3
    assert s.group_id == 7 and s.status is Status.COMPLETED and s.metadata["turns"] == 3
    assert len(s.response_ids) == len(s.loss_mask) == len(s.rollout_logprobs) == len(s.weight_versions)


def test_changed_tools_start_a_new_root(tokenizers):
    tok = tokenizers["qwen2.5"]
    session = Session("s", ChatTemplate(tok))
    history = [{"role": "user", "content": "hello"}]
    _, m = answer(session, session.plan(history, TOOLS), "hi", tools=True)
    follow = history + [m, {"role": "user", "content": "again"}]
    assert session.plan(follow, TOOLS).parent is not None
    assert session.plan(follow, None).parent is None  # the system prompt the model saw differs


def test_reply_parsing():
    chatml, qwen3, llama3 = FAMILIES["chatml"], FAMILIES["qwen3"], FAMILIES["llama3"]
    text = 'let me add\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>'
    reply = parse_reply(text, chatml, True)
    assert reply["content"] == "let me add"
    assert reply["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expr": "1+2"}'}
    assert "tool_calls" not in parse_reply(text, chatml, False)  # no tools offered: plain text
    broken = '<tool_call>\n{"name": "calc", "arguments": {"expr": \n</tool_call>'
    kept = parse_reply(broken, chatml, True)  # a malformed call stays text, and is counted
    assert kept == {"role": "assistant", "content": broken, "malformed_tool_calls": 1}
    assert parse_reply("<think>\nhm\n</think>\n\nok", qwen3, False)["reasoning_content"] == "hm"
    assert parse_reply('{"name": "calc", "parameters": {"expr": "2"}}', llama3, True)["content"] is None
    assert parse_reply("just words", llama3, True) == {"role": "assistant", "content": "just words"}


def test_unknown_template_family_is_refused():
    with pytest.raises(ValueError, match="template_family"):
        detect_family("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
