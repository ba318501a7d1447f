"""One token-faithful chat session: the next prompt is the recorded tokens plus the appended messages.

The engine's reply tokens are recorded as they came (miles/agentic/trajectory.py) and never rendered
or tokenized again. For a follow-up call only the messages the client appended after the last
recorded reply are tokenized, with the model's own chat template:

    appended text = render(history with the recorded reply replaced by a marker, generation prompt)
                    cut just after the end-of-turn token that closes the marker's turn

Rendering the full history (not the appended messages alone) keeps whatever the template derives
from it (tool-message grouping, system prompts, the last user query); replacing the recorded reply
by a marker and cutting after its end-of-turn makes the result independent of how the template
would re-render that reply. This one rule covers the known breakages of naive re-rendering, per
template family (FAMILIES), each tested in tests/unit/test_session_tokens.py:

- ChatML / Qwen2.5: the engine stops at `<|im_end|>`; the newline the template puts after it is
  not in the record, so it opens the appended text (it follows the end-of-turn token).
- Qwen3: the template drops the `<think>` block of earlier replies once a new user turn comes, and
  inserts an empty `<think></think>` into the last reply; neither touches the record.
- Llama 3: the engine stops at `<|eot_id|>`, after which the next header follows directly.
- Tool-call arguments re-serialised by the client (`{"a":1}` for `{"a": 1}`): a sent assistant
  message is matched to the recorded reply by meaning (content, tool names, parsed arguments), not
  by its text, and is never tokenized.
- A client that edits earlier history: the history no longer matches the record past some node, so
  the call continues that node as a new branch (a fork); the edited messages are appended tokens
  with loss mask 0. Nothing recorded is re-tokenized.

A reply cut by `length` (or by a stop string) has no end-of-turn token; the next appended part then
starts with one (mask 0).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from miles.agentic.trajectory import Node, TrajectoryTree
from miles.chat.render import template_messages
from miles.chat.toolcalls import template_family
from miles.sample import Sample


@dataclass(frozen=True)
class TemplateFamily:
    """What the session needs to know about a family of chat templates."""

    name: str
    turn_end: str
    """The token that ends an assistant turn (the engine's stop token)."""
    markers: tuple[str, ...]
    """Strings whose presence in a chat template identifies the family."""
    tool_format: str
    """How the model writes tool calls: `tool_call_tags` (`<tool_call>{json}</tool_call>`) or `json`."""
    thinks: bool = False
    """The model opens its reply with a `<think>` block (returned as `reasoning_content`)."""


FAMILIES = {
    "qwen3": TemplateFamily("qwen3", "<|im_end|>", ("<|im_start|>", "<think>"), "tool_call_tags", True),
    "chatml": TemplateFamily("chatml", "<|im_end|>", ("<|im_start|>",), "tool_call_tags"),
    "llama3": TemplateFamily("llama3", "<|eot_id|>", ("<|start_header_id|>", "<|eot_id|>"), "json"),
}
"""Known families, detected in this order (qwen3 before its chatml parent)."""


def detect_family(chat_template: str) -> TemplateFamily:
    """The family of a tokenizer's chat template, by the rule the engine's OpenAI routes use
    (miles.chat.toolcalls.template_family; Qwen2.5's template is a ChatML one here)."""
    name = template_family(chat_template)
    if name is None or not all(m in chat_template for m in FAMILIES[_SESSION_FAMILY.get(name, name)].markers):
        raise ValueError(
            "the tokenizer's chat template matches no known family; pass template_family= one of "
            f"{', '.join(FAMILIES)} to the session server"
        )
    return FAMILIES[_SESSION_FAMILY.get(name, name)]


_SESSION_FAMILY = {"qwen2.5": "chatml"}
"""Tool-call families that share a session family."""


class ChatTemplate:
    """A tokenizer's chat template, rendered for first prompts and for appended messages."""

    def __init__(self, tokenizer: Any, family: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; sessions need one to render messages")
        if family is not None and family not in FAMILIES:
            raise ValueError(f"unknown template family {family!r}; known: {', '.join(FAMILIES)}")
        self.tokenizer = tokenizer
        self.family = FAMILIES[family] if family else detect_family(tokenizer.chat_template)
        ids = self.encode(self.family.turn_end)
        if len(ids) != 1:
            raise ValueError(f"{self.family.turn_end!r} is not one token of this tokenizer ({ids})")
        self.turn_end_id = ids[0]
        self._marker = f"\x00turn-{uuid.uuid4().hex}\x00"
        self._compiled = _compiled(tokenizer.chat_template)
        self._specials = dict(getattr(tokenizer, "special_tokens_map", {}))

    def encode(self, text: str) -> list[int]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # the Rust tokenizer, no wrapper
        if backend is not None:  # encode_batch releases the GIL while it works (encode holds it)
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, options: dict[str, Any], gen: bool
    ) -> str:
        if self._compiled is not None:  # messages are plain JSON data: no conversion needed
            kwargs = {**self._specials, **options}
            return self._compiled.render(
                messages=messages, tools=tools or None, add_generation_prompt=gen, **kwargs
            )
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=gen, tokenize=False, **options
        )

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, options: dict[str, Any]
    ) -> list[int]:
        """A first prompt: the whole history rendered with the generation prompt."""
        return self.encode(self.render(messages, tools, options, gen=True))

    def appended_ids(
        self,
        messages: list[dict[str, Any]],
        reply_index: int,
        tools: list[dict] | None,
        options: dict[str, Any],
        closed: bool,
    ) -> list[int]:
        """Tokens that follow the recorded reply at `messages[reply_index]`: the end of its turn
        (the end-of-turn token only when the record lacks it, `closed` False), the messages after it
        and the generation prompt."""
        stand_in = list(messages)
        stand_in[reply_index] = {"role": "assistant", "content": self._marker}
        text = self.render(stand_in, tools, options, gen=True)
        start = text.find(self._marker)
        end = text.find(self.family.turn_end, start + len(self._marker)) if start >= 0 else -1
        if end < 0:
            raise ValueError(
                f"the chat template did not render the assistant turn at message {reply_index} "
                f"followed by {self.family.turn_end!r}; is template_family {self.family.name!r} right?"
            )
        tail = self.encode(text[end + len(self.family.turn_end) :])
        return tail if closed else [self.turn_end_id] + tail


def _compiled(chat_template: str) -> Any:
    """transformers' compiled Jinja template (its sandbox, filters and globals), or None.

    Rendering it directly skips `apply_chat_template`'s conversion of rich message objects to plain
    data, most of a turn's rendering time; session messages are plain JSON data already. Where that
    helper is missing (another transformers version), `apply_chat_template` is used."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(chat_template)
    except (ImportError, AttributeError):
        return None


# ---- messages ----


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A request message as chat templates expect it (miles.chat.render.template_messages: content
    one string, tool-call arguments as objects), with unset fields dropped and OpenAI's `developer`
    role as `system`."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("role") == "developer":  # OpenAI's newer name for the system role
        out["role"] = "system"
    if out.get("role") == "assistant" and not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return template_messages([out])[0]


_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.S)


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    return _THINK.sub("", content).strip()


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return arguments


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return calls


def same_reply(sent: dict[str, Any], recorded: dict[str, Any]) -> bool:
    """Whether the assistant message a client sent back is the recorded reply: same text (ignoring
    surrounding whitespace and a `<think>` block) and the same tool calls by name and parsed
    arguments (clients re-serialise arguments JSON); reasoning and ids are not compared."""
    return (
        sent.get("role") == "assistant"
        and _text(sent) == _text(recorded)
        and _calls(sent) == _calls(recorded)
    )


def same_input(sent: dict[str, Any], recorded: dict[str, Any]) -> bool:
    """Whether a message the client sent equals one recorded as appended (exact, as rendered)."""
    if sent.get("role") == "assistant" and recorded.get("role") == "assistant":
        return same_reply(sent, recorded) and sent.get("content") == recorded.get("content")
    return sent == recorded


def tools_key(tools: list[dict] | None, options: dict[str, Any]) -> str:
    return json.dumps([tools or [], options], sort_keys=True, separators=(",", ":"))


# ---- the session ----


@dataclass
class Turn:
    """A planned call: where it attaches in the tree and the prompt to send."""

    parent: Node | None
    messages: list[dict[str, Any]]
    """The request's messages not yet covered by the record."""
    appended_ids: list[int]
    prompt_ids: list[int]
    """The full prompt for the engine: the parent's recorded tokens plus `appended_ids`."""
    tools_key: str
    forked: bool
    """The call starts a new branch beside an existing one."""


class Session:
    """The record of one episode: a trajectory tree over one chat template."""

    def __init__(self, session_id: str, template: ChatTemplate, metadata: dict[str, Any] | None = None):
        self.id = session_id
        self.template = template
        self.metadata = dict(metadata or {})
        self.tree = TrajectoryTree()
        self.forks = 0

    def plan(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        options: dict[str, Any] | None = None,
    ) -> Turn:
        """The prompt of a call with history `messages` (template_message form)."""
        options = dict(options or {})
        key = tools_key(tools, options)
        parent, covered = self.tree.match(messages, key, same_input, same_reply)
        new = messages[covered:]
        if parent is None:
            appended = self.template.prompt_ids(messages, tools, options)
            forked = bool(self.tree.roots)
            prompt = appended
        else:
            closed = bool(parent.output_ids) and parent.output_ids[-1] == self.template.turn_end_id
            appended = self.template.appended_ids(messages, covered - 1, tools, options, closed)
            forked = bool(parent.children)
            prompt = parent.token_ids() + appended
        return Turn(parent, new, appended, prompt, key, forked)

    def record(
        self,
        turn: Turn,
        output_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        reply: dict[str, Any],
        finish_reason: str,
    ) -> Node:
        """Add the engine's answer to `turn` as a node (the tree may have grown meanwhile)."""
        forked = bool(turn.parent.children) if turn.parent is not None else bool(self.tree.roots)
        self.forks += int(forked)
        return self.tree.add(
            turn.parent,
            turn.messages,
            turn.appended_ids,
            output_ids,
            logprobs,
            versions,
            reply,
            finish_reason,
            turn.tools_key,
        )

    def samples(self) -> list[Sample]:
        """One Sample per branch; metadata carries the session id, its metadata and the branch."""
        meta = {"session_id": self.id, "forks": self.forks, **self.metadata}
        return self.tree.samples(int(self.metadata.get("group_id", 0)), meta)
