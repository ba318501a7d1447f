"""Tool calls out of an assistant's text, in the two forms the environments accept.

- Standard (Qwen2.5 / Qwen3 / Hermes): `<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>`;
  `arguments` may also be a JSON string holding the object.
- Compact (short in tokens, for tiny models): `<tool_call>calc 2+3</tool_call>`, the tool name, one
  space, then the value of the tool's one primary argument as plain text (see `Tool.primary`).

`normalize_action` also takes what an OpenAI client holds: an assistant message dict (its
`tool_calls` plus any blocks left in its `content`, e.g. the compact form or a malformed block that
`miles.chat.toolcalls` kept as text) or a list of OpenAI `tool_calls` dicts.

A `<tool_call>` block that parses as neither becomes a `MalformedCall`, and so does an unclosed
block: the environment answers it with a tool-error message rather than ending the episode.
Text outside the blocks is the assistant's prose (its final answer when there are no blocks).
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles.agentic.envs.base import MalformedCall, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_COMPACT = re.compile(r"\s*([A-Za-z_][\w.-]*)(?:\s+(.*?))?\s*\Z", re.DOTALL)


def parse_tool_calls(text: str, primary: dict[str, str]) -> tuple[str, list[ToolCall | MalformedCall]]:
    """(prose outside the blocks, calls in order); `primary` maps a tool name to its compact argument."""
    calls: list[ToolCall | MalformedCall] = []
    for i, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1)
        closed = match.group(0).endswith(CLOSE)
        call = _parse_block(body, primary) if closed else MalformedCall(body, f"unclosed {OPEN}")
        call.id = f"call_{i}"
        calls.append(call)
    prose = _BLOCK.sub("", text).strip()
    return prose, calls


def _parse_block(body: str, primary: dict[str, str]) -> ToolCall | MalformedCall:
    stripped = body.strip()
    if stripped.startswith("{"):
        return _parse_json(stripped)
    match = _COMPACT.match(stripped)
    if not match:
        return MalformedCall(body, "expected `NAME ARG` or a JSON object with name and arguments")
    name, arg = match.group(1), match.group(2) or ""
    if name not in primary:
        return MalformedCall(body, f"unknown tool {name!r}; known: {', '.join(sorted(primary))}")
    return ToolCall(name, {primary[name]: arg})


def _parse_json(body: str) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"invalid JSON: {e.msg} at column {e.colno}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return MalformedCall(body, "a tool call needs a string `name`")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return MalformedCall(body, f"`arguments` is not a JSON object: {e.msg}")
    if not isinstance(args, dict):
        return MalformedCall(body, "`arguments` must be a JSON object")
    return ToolCall(obj["name"], args)


def normalize_action(action: Any, primary: dict[str, str]) -> tuple[str, list[ToolCall | MalformedCall]]:
    """(prose, calls) of any accepted action: text, an assistant message, or a list of calls."""
    if isinstance(action, str):
        return parse_tool_calls(action, primary)
    if isinstance(action, dict):
        prose, calls = parse_tool_calls(action.get("content") or "", primary)
        return prose, [openai_call(c) for c in action.get("tool_calls") or []] + calls
    calls = [c if isinstance(c, (ToolCall, MalformedCall)) else openai_call(c) for c in action]
    return "", calls


def openai_call(call: Any) -> ToolCall | MalformedCall:
    """A ToolCall from an OpenAI `tool_calls` entry (`arguments` a JSON string or an object)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        ident = str(call.get("id") or "") if isinstance(call, dict) else ""
        return MalformedCall(str(call)[:200], "a tool call needs a `function` object", ident)
    fn = call["function"]
    parsed = _parse_json(json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})}))
    parsed.id = str(call.get("id") or "")
    return parsed
