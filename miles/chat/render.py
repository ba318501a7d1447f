"""OpenAI chat messages -> prompt text and token ids, through the tokenizer's own chat template.

The Hugging Face tokenizer of the model directory renders (`apply_chat_template(messages, tools=...,
add_generation_prompt=...)`), so tools reach the prompt exactly as the model family's template
writes them; the rendered text is then encoded without adding special tokens (the template already
wrote them). transformers is imported on first use only.

Messages are first made into the plain dicts templates expect (`template_messages`): content parts
joined into one string, missing content as "", and each assistant tool call's `arguments` JSON
string parsed back into an object (templates such as Qwen2.5's and Llama 3's write it with
`tojson`; a string would be quoted twice). An argument string that is not a JSON object is kept
as given.

Public API: `ChatRenderer(model_dir)` with `.family` (miles/chat/toolcalls.py), `.render_text(...)`
and `.render_ids(...)`; `template_messages(messages)`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from miles.chat.toolcalls import detect_family, template_tools


def _plain(message: Any) -> dict[str, Any]:
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)


def _arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages (pydantic models or dicts) as the dicts chat templates take (module docstring)."""
    out = []
    for message in messages:
        m = _plain(message)
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(_part_text(p) for p in content)
        m["content"] = content if content is not None else ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _part_text(part: dict[str, Any]) -> str:
    if part.get("type") != "text":
        raise ValueError(f"only text content parts can be rendered, got type {part.get('type')!r}")
    return part["text"]


class ChatRenderer:
    """Renders chat requests for one model directory (module docstring)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.family = detect_family(self.model_dir)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
                if not self._tokenizer.chat_template:
                    raise ValueError(
                        f"{self.model_dir} has no chat template (chat_template.jinja or "
                        "tokenizer_config.json 'chat_template'); use /v1/completions or add one"
                    )
            return self._tokenizer

    def render_text(
        self,
        messages: list[Any],
        tools: list[Any] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of `messages` (and `tools`) as the chat template writes it."""
        return self.tokenizer.apply_chat_template(
            template_messages(messages),
            tools=template_tools(tools),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )

    def render_ids(
        self,
        messages: list[Any],
        tools: list[Any] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt token ids of `messages` (and `tools`)."""
        text = self.render_text(messages, tools, add_generation_prompt, template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))
