"""OpenAI's request and reply bodies for `/v1/chat/completions`, `/v1/completions` and `/v1/models`.

Shared by the engine's OpenAI routes (miles/engine/openai_routes.py) and the session server, so both
accept and answer exactly the same shapes. Requests are checked strictly: a field OpenAI does not
define (and that is not one of SGLang's extensions listed below) or one this project does not honour
(`audio`, `functions`, image parts, ...) is a 400 naming the field, never silently ignored.

Public API:
- `ChatCompletionRequest`, `CompletionRequest`: request bodies (pydantic v2, extra="forbid").
- `parse_request(model, data) -> model`: validation with OpenAI's error body on failure.
- `OpenAIError`: an error answer (status, message, type, param, code); `.body()` is OpenAI's
  `{"error": {"message", "type", "param", "code"}}`.
- `message_text(content)`: a message's content (string, parts or None) as one string.
- Reply shapes: `ChatCompletion`, `ChatCompletionChunk`, `Completion` (also the completion stream
  chunk, as in OpenAI), `ModelList`, with their parts (`ChatMessage`, `ToolCall`, `ChoiceLogprobs`,
  `CompletionLogprobs`, `Usage`, ...). Optional extension fields are left out of the JSON when unset.

SGLang extensions accepted (names as in sglang/srt/entrypoints/openai/protocol.py):
- sampling: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
  `no_stop_trim`, `skip_special_tokens`, `regex`, `ebnf`, `json_schema`, `rid`.
- chat: `input_ids` (prompt token ids used as given instead of rendering `messages`),
  `chat_template_kwargs`, `return_token_ids` (each choice carries `prompt_token_ids` and
  `response_token_ids`), `return_prompt_token_ids`, `return_meta_info` (each choice carries the
  native `/generate` `meta_info`: `output_token_logprobs`, `weight_version`, per-token weight
  versions, finish reason, cached tokens).
- completions: `return_token_ids` (each choice carries `prompt_token_ids` and `token_ids`).

Accepted without effect (clients send them routinely): `user`, `metadata`, `store`,
`parallel_tool_calls` (not enforced), `reasoning_effort` (thinking is switched by the template's
`chat_template_kwargs`), `response_format: {"type": "text"}`, `service_tier: "auto"`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

MAX_N = 128
"""Most choices one request may ask for (`n`)."""
MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on `top_logprobs` (chat) and `logprobs` (completions, OpenAI says 5; we allow 20)."""

UNSUPPORTED_FIELDS = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' field is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; send 'tool_choice'",
    "best_of": "best_of is not supported; use n",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "response_format": "response_format is not supported; use the 'regex', 'ebnf' or 'json_schema' extension",
    "service_tier": "service tiers are not supported",
}
"""Fields OpenAI defines that this project does not honour: a non-null value is a 400 with this reason."""
_NO_OPS = {"response_format": ({"type": "text"},), "service_tier": ("auto", "default")}
"""Values of those fields that ask for nothing beyond the default: accepted."""


class OpenAIError(Exception):
    """An error answer in OpenAI's shape, with the HTTP status to send it with."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.param = param
        self.type = type or _error_type(status)
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def _error_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------------
# Requests


class TextPart(_Body):
    """A text content part: `{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: str


Content = str | list[TextPart]


def message_text(content: str | list[TextPart] | None) -> str | None:
    """A message's content as one string (text parts joined without a separator, as OpenAI does)."""
    if content is None or isinstance(content, str):
        return content
    return "".join(p.text for p in content)


class FunctionCall(_Body):
    """The function of a tool call: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(_Body):
    """A tool call: `{"id", "type": "function", "function": {"name", "arguments"}}`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Body):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Body):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    """SGLang's extension: the reasoning text of a thinking model's earlier turn."""


class ToolMessage(_Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    """A tool offered to the model: `{"type": "function", "function": {...}}`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """`tool_choice` naming one function: `{"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool | None = None
    """Send a last chunk with `usage` and no choices before `data: [DONE]`."""
    continuous_usage_stats: bool | None = None
    """SGLang's extension: `usage` on every chunk."""


Stop = str | list[str]
NonNegativeInt = Annotated[int, Field(ge=0, le=2**62)]


class _Sampling(_Body):
    """Options shared by both generation routes (OpenAI's names, then SGLang's extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: NonNegativeInt = 0
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    rid: str | None = None
    lora_path: str | list[str | None] | None = None
    """SGLang's extension: the LoRA adapter to run with (also `model: "<base>:<adapter>"`, which wins)."""
    return_token_ids: bool = False
    """Each choice carries the prompt's and its output's token ids."""
    # OpenAI fields not honoured (UNSUPPORTED_FIELDS): accepted as null only
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    service_tier: Any = None


class ChatCompletionRequest(_Sampling):
    """The `/v1/chat/completions` body."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """Accepted, not enforced: a model that writes several calls gets them all."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of `max_completion_tokens`; the latter wins when both are set."""
    max_completion_tokens: int | None = Field(None, ge=1)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """Accepted for client compatibility; thinking is switched by `chat_template_kwargs`."""
    # SGLang extensions
    input_ids: list[NonNegativeInt] | None = None
    """The prompt as token ids, used as given (then `messages` only serve tool-call parsing)."""
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    """The `/v1/completions` body: a prompt as text, a list of texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[NonNegativeInt] | list[list[NonNegativeInt]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    def max_new_tokens(self) -> int | None:
        return self.max_tokens


_M = TypeVar("_M", bound=BaseModel)


def parse_request(model: type[_M], data: Any) -> _M:
    """`data` validated as `model`; an `OpenAIError` (400) naming the first bad field otherwise."""
    if not isinstance(data, dict):
        raise OpenAIError("the request body must be a JSON object")
    for name, reason in UNSUPPORTED_FIELDS.items():
        if data.get(name) not in (None, False, *_NO_OPS.get(name, ())) and name in model.model_fields:
            raise OpenAIError(f"'{name}': {reason}", param=name, code="unsupported_parameter")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, data) from None
    _check_consistency(req)
    return req


def _validation_error(e: ValidationError, data: Any) -> OpenAIError:
    # a union reports one error per member: the one reaching deepest into the body is the telling one
    errors = [(err, _param(err["loc"], data)) for err in e.errors(include_url=False)]
    # (and at equal depth a bad value tells more than a member of the wrong type)
    err, param = max(
        errors, key=lambda ep: (len((ep[1] or "").split(".")), not ep[0]["type"].endswith("_type"))
    )
    if err["type"] == "extra_forbidden":
        return OpenAIError(f"unknown field '{param}'", param=param, code="unknown_parameter")
    if err["type"] == "missing":
        return OpenAIError(f"'{param}' is required", param=param, code="missing_required_parameter")
    return OpenAIError(f"'{param}': {err['msg']}", param=param, code="invalid_value")


def _param(loc: tuple[Any, ...], data: Any) -> str | None:
    """The dotted path of `loc` in the body, without pydantic's union-member labels."""
    path: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        elif i == len(loc) - 1 and isinstance(data, dict):
            pass  # a missing or unknown key: named, not entered
        else:
            continue
        path.append(str(part))
    return ".".join(path) or None


def _check_consistency(req: BaseModel) -> None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if req.stream and (req.return_token_ids or req.return_prompt_token_ids or req.return_meta_info):
            raise OpenAIError(
                "return_token_ids, return_prompt_token_ids and return_meta_info need stream=false",
                param="stream",
            )
        if isinstance(req.tool_choice, NamedToolChoice) or req.tool_choice == "required":
            if not req.tools:
                raise OpenAIError("'tool_choice' names tools but 'tools' is empty", param="tool_choice")
    if getattr(req, "stream_options", None) is not None and not req.stream:  # type: ignore[attr-defined]
        raise OpenAIError("'stream_options' is only allowed with stream=true", param="stream_options")


# ---------------------------------------------------------------------------------------------------
# Replies


class _Reply(BaseModel):
    """A reply object; the fields named in `omit_if_none` are left out of the JSON when unset."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class TopLogprob(_Reply):
    token: str
    logprob: float | None
    bytes: list[int] | None


class TokenLogprob(_Reply):
    token: str
    logprob: float | None
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Reply):
    """Chat logprobs: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}`."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ReplyFunction(_Reply):
    name: str
    arguments: str


class ReplyToolCall(_Reply):
    id: str
    type: Literal["function"] = "function"
    function: ReplyFunction


class ChatMessage(_Reply):
    omit_if_none: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning_content")

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ReplyToolCall] | None = None
    reasoning_content: str | None = None


FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "abort"]


class ChatChoice(_Reply):
    omit_if_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "response_token_ids", "meta_info")

    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None
    matched_stop: int | str | None = None
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    meta_info: dict[str, Any] | None = None


class PromptTokensDetails(_Reply):
    cached_tokens: int = 0


class Usage(_Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def _now() -> int:
    return int(time.time())


class ChatCompletion(_Reply):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunction(_Reply):
    omit_if_none: ClassVar[tuple[str, ...]] = ("name", "arguments")

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Reply):
    omit_if_none: ClassVar[tuple[str, ...]] = ("id", "type", "function")

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class Delta(_Reply):
    omit_if_none: ClassVar[tuple[str, ...]] = (
        "role",
        "content",
        "tool_calls",
        "reasoning_content",
        "refusal",
    )

    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChunkChoice(_Reply):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Reply):
    """One server-sent event of a chat stream; the usage chunk has `choices: []`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Reply):
    """Completions logprobs: parallel lists over the output tokens."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]] | None
    text_offset: list[int]


class CompletionChoice(_Reply):
    omit_if_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    matched_stop: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(_Reply):
    """A `/v1/completions` reply; its stream chunks have the same shape (OpenAI's `text_completion`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Reply):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "miles"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (SGLang's field); None for the base model itself."""
    max_model_len: int | None = None


class ModelList(_Reply):
    object: Literal["list"] = "list"
    data: list[ModelCard]
