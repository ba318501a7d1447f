"""Tool calls in model output, per model family, as OpenAI `tool_calls`.

Public API:
- `detect_family(model_dir) -> str`: the template family of a model directory, one of `FAMILIES`
  ("qwen2.5", "qwen3", "chatml", "llama3"), from the chat template's markers and config.json's
  `model_type`; `template_family(template)` the same rule for a template string (the session server's).
- `parse_tool_calls(text, family) -> ParsedToolCalls(content, tool_calls, malformed)`: the calls in
  one finished output. `tool_calls` are OpenAI dicts `{"id", "type": "function", "function": {"name",
  "arguments"}}` with `arguments` a JSON string (re-serialised with `json.dumps(ensure_ascii=False)`,
  so it is not byte-equal to what the model wrote). A call block whose JSON does not parse, or that
  lacks a name, stays in `content` verbatim and counts in `malformed`; nothing here raises.
  `content` is the remaining text, stripped, or None when empty and there are calls (as OpenAI).
- `ToolCallStream(family)`: the same while text streams in: `feed(delta)` returns the text that is
  certainly content (held back while it could still begin a call), `finish()` returns the rest as a
  `ParsedToolCalls` whose `content` is only what was not yet fed out.
- `template_tools(tools)`: OpenAI `tools` as the list of dicts chat templates take (`tools=`).

Formats:
- "qwen2.5", "qwen3", "chatml" (Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, text around them is content; an unterminated last block (output cut by
  length) is parsed if its JSON is complete.
- "llama3" (Llama 3.1-3.3 JSON tool calling): the whole output is `{"name": ..., "parameters":
  {...}}` (`"arguments"` accepted), optionally after `<|python_tag|>`, several separated by `;`.

The tool schemas reach the prompt through the tokenizer's own chat template
(`apply_chat_template(messages, tools=...)`, see miles/chat/render.py); nothing here renders them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
LLAMA_TAG = "<|python_tag|>"

FAMILIES = {
    "qwen2.5": "hermes",
    "qwen3": "hermes",
    "chatml": "hermes",
    "llama3": "llama3",
}
"""Template family -> tool-call format."""


@dataclass
class ParsedToolCalls:
    """What one output says: its content text and its tool calls in OpenAI's shape."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0
    """Number of call blocks that did not parse (left in `content`)."""


def _format(family: str) -> str:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown tool-call family {family!r}; known: {sorted(FAMILIES)}") from None


def _read_template(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg_file = model_dir / "tokenizer_config.json"
    template = json.loads(cfg_file.read_text()).get("chat_template") if cfg_file.exists() else None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = " ".join(t.get("template", "") for t in template)
    return template or ""


def template_family(template: str, model_type: str = "") -> str | None:
    """The family of a chat template (module docstring): Llama 3 header markers mean "llama3"; ChatML
    markers mean "qwen3" for a qwen3 model or a template that knows `<think>`, "qwen2.5" for a qwen2
    model, else "chatml". A template with neither marker falls back on the model type; None when
    that says nothing either."""
    if "<|start_header_id|>" in template or (not template and model_type == "llama"):
        return "llama3"
    if model_type.startswith("qwen3") or "<think>" in template:
        return "qwen3"
    if model_type.startswith("qwen2"):
        return "qwen2.5"
    return "chatml" if "<|im_start|>" in template else None


def detect_family(model_dir: str | Path) -> str:
    """The template family of `model_dir`: its chat template and config.json's `model_type`
    (`template_family`), "chatml" when neither tells."""
    model_dir = Path(model_dir)
    cfg_file = model_dir / "config.json"
    model_type = json.loads(cfg_file.read_text()).get("model_type", "") if cfg_file.exists() else ""
    return template_family(_read_template(model_dir), model_type) or "chatml"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


MAX_JSON_DEPTH = 64
"""Deeper arguments are a malformed call: a model's reply must not reach the JSON parser's recursion
limit (a reply of a thousand `[` would otherwise end the request in a RecursionError)."""


def _too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether brackets outside JSON strings nest deeper than `limit` (one linear scan, no recursion)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _call(obj: Any) -> dict[str, Any] | None:
    """An OpenAI tool call from a parsed `{"name", "arguments" | "parameters"}` object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def _loads(text: str) -> Any:
    """The JSON value of `text`, or None when it is not JSON or nests deeper than MAX_JSON_DEPTH."""
    if _too_deep(text):
        return None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


_HERMES_BLOCK = re.compile(re.escape(HERMES_START) + r"(.*?)(?:" + re.escape(HERMES_END) + r"|\Z)", re.DOTALL)


def _parse_hermes(text: str) -> ParsedToolCalls:
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    malformed = 0
    pos = 0
    for m in _HERMES_BLOCK.finditer(text):
        kept.append(text[pos : m.start()])
        call = _call(_loads(m.group(1).strip()))
        if call is None:
            malformed += 1
            kept.append(m.group(0))
        else:
            calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    return _result("".join(kept), calls, malformed)


def _result(content: str, calls: list[dict[str, Any]], malformed: int) -> ParsedToolCalls:
    content = content.strip() if calls else content
    return ParsedToolCalls(content or (None if calls else content), calls, malformed)


def _llama_start(text: str) -> int | None:
    """Where a Llama 3 call begins: at `<|python_tag|>`, or at 0 when the output opens with `{`."""
    tag = text.find(LLAMA_TAG)
    if tag != -1:
        return tag
    return 0 if text.lstrip().startswith("{") else None


def _parse_llama3(text: str) -> ParsedToolCalls:
    start = _llama_start(text)
    if start is None:
        return ParsedToolCalls(text)
    action = text[start:].removeprefix(LLAMA_TAG) if text[start:].startswith(LLAMA_TAG) else text[start:]
    if _too_deep(action):
        return ParsedToolCalls(text, [], 1)
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    idx = 0
    while True:
        while idx < len(action) and action[idx] in " \t\r\n;":
            idx += 1
        if idx >= len(action):
            break
        try:
            obj, idx = decoder.raw_decode(action, idx)
        except (json.JSONDecodeError, RecursionError):
            return ParsedToolCalls(text, [], 1)
        call = _call(obj)
        if call is None:
            return ParsedToolCalls(text, [], 1)
        calls.append(call)
    return _result(text[:start], calls, 0)


def parse_tool_calls(text: str, family: str) -> ParsedToolCalls:
    """The tool calls in one finished output of a `family` model (module docstring)."""
    if _format(family) == "llama3":
        return _parse_llama3(text)
    return _parse_hermes(text)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Streaming form of `parse_tool_calls`: content goes out as soon as it cannot begin a call."""

    def __init__(self, family: str):
        self.format = _format(family)
        self.family = family
        self.text = ""
        self.sent = 0
        """Characters of `text` already returned by `feed`."""
        self.call_at: int | None = None
        """Where the first call begins, once seen: nothing from there on is fed out."""

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.call_at is None:
            self.call_at = self._start()
        end = self.call_at if self.call_at is not None else len(self.text) - self._hold()
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
        return out

    def _start(self) -> int | None:
        if self.format == "llama3":
            return _llama_start(self.text)
        at = self.text.find(HERMES_START)
        return None if at == -1 else at

    def _hold(self) -> int:
        if self.format == "llama3":
            if LLAMA_TAG.startswith(self.text.lstrip()):  # only blanks, or the tag's beginning, so far
                return len(self.text)
            return _held(self.text, LLAMA_TAG)
        return _held(self.text, HERMES_START)

    def finish(self) -> ParsedToolCalls:
        """The calls, and the content not yet fed out (None when there is none)."""
        parsed = parse_tool_calls(self.text, self.family)
        if not parsed.tool_calls:
            rest = self.text[self.sent :]
        else:
            rest = parse_tool_calls(self.text[self.call_at :], self.family).content or ""
            rest = rest if self.sent == 0 else rest.rstrip()
        return ParsedToolCalls(rest or None, parsed.tool_calls, parsed.malformed)


def template_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """OpenAI `tools` (pydantic models or dicts) as plain dicts for `apply_chat_template(tools=...)`."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else dict(t) for t in tools]
