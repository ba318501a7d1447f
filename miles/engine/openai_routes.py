"""OpenAI's API over the embedded engine: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Bodies are miles/chat/openai_schema.py's (strict: an unknown or unsupported field is a 400 naming
it). A request becomes a native `/generate` body and takes the native path (miles/engine/server.py
`prepare`: the same checks, options, `n` samples, rids, grammars); its replies are translated into
OpenAI's shapes. Streams are the native stream's events (miles/engine/streaming.py, incremental)
translated chunk by chunk into OpenAI's server-sent events, ending with `data: [DONE]`.

Chat prompts are rendered by the tokenizer's own chat template with the request's `tools`
(miles/chat/render.py); with tools offered and `tool_choice` not "none", the output is parsed for
tool calls of the model's family (miles/chat/toolcalls.py) into `message.tool_calls`, and a natural
stop becomes `finish_reason: "tool_calls"`. A call block that does not parse stays in `content`.
`tool_choice: "required"` or a named function constrains the output with a regex (the family's
call format, the name fixed, the arguments any one-line JSON object); it cannot be combined with
the `regex` / `ebnf` / `json_schema` extensions.

Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(also every 400 of the native checks), 413 for a body over `--max-request-bytes`, 503 while the
engine is unhealthy, 500 when the engine fails a request. In a stream that has started, an engine
failure is one `data: {"error": ...}` event, then `data: [DONE]`.

For token-faithful callers (SGLang's names): `return_token_ids` puts `prompt_token_ids` and
`response_token_ids` (completions: `token_ids`) on each choice, `return_meta_info` the native
`meta_info` (per-token log-probs as `[logprob, token_id, null]` rows when `logprobs` is on, the weight
version of each output token, cached tokens); chat's `input_ids` is a prompt used as given. Token
ids cover every output token, also a matched stop token that the text leaves out.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles.chat import openai_schema as oa
from miles.chat.render import ChatRenderer
from miles.chat.token_bytes import TokenBytes
from miles.chat.toolcalls import FAMILIES, ParsedToolCalls, ToolCallStream, parse_tool_calls
from miles.engine import streaming
from miles.engine.request import Request as EngineRequest
from miles.engine.validation import GenerateReqInput, HTTPError, read_body

if TYPE_CHECKING:
    from miles.engine.server import EngineState

log = logging.getLogger(__name__)

Items = list[tuple[EngineRequest, bool]]


def _error_response(e: oa.OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _from_http(e: HTTPError) -> oa.OpenAIError:
    return oa.OpenAIError(str(e), e.status)


async def _read(request: Request, model: type[oa._Body]) -> Any:
    """The body validated as `model`; OpenAIError otherwise."""
    try:
        raw = await read_body(request, request.app.state.max_request_bytes)
    except HTTPError as e:
        raise _from_http(e) from None
    try:
        data = pydantic_core.from_json(raw) if raw else {}
    except ValueError as e:
        raise oa.OpenAIError(f"request body is not valid JSON: {e}") from None
    return oa.parse_request(model, data)


def _sampling(req: oa.ChatCompletionRequest | oa.CompletionRequest, max_new_tokens: int) -> dict[str, Any]:
    """The native sampling_params of an OpenAI request."""
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
    for name, key in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("seed", "sampling_seed"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("repetition_penalty", "repetition_penalty"),
        ("stop", "stop"),
        ("stop_token_ids", "stop_token_ids"),
        ("logit_bias", "logit_bias"),
        ("regex", "regex"),
        ("ebnf", "ebnf"),
        ("json_schema", "json_schema"),
    ):
        value = getattr(req, name, None)
        if value is not None:
            sp[key] = value
    sp.update(
        ignore_eos=req.ignore_eos,
        no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens,
        min_new_tokens=req.min_tokens,
    )
    return sp


def _max_new_tokens(state: EngineState, req: Any, prompt_len: int) -> int:
    n = req.max_new_tokens()
    return n if n is not None else max(state.scheduler.max_context - prompt_len, 0)


async def _start(state: EngineState, body: GenerateReqInput) -> Items:
    """Checked, submitted engine requests of a native body (the /generate path), with their logprob flags."""
    from miles.engine import intake, server

    try:
        await intake.precompile(state, body)
        items = server.prepare(state, body)
    except HTTPError as e:
        raise _from_http(e) from None
    for r, _ in items:
        state.scheduler.submit(r)
    return items


async def _finish(state: EngineState, items: Items) -> list[dict[str, Any]]:
    """The native replies of submitted requests, once all are done; aborted if the client goes."""
    from miles.engine import server

    try:
        await asyncio.gather(*(asyncio.wrap_future(r.done) for r, _ in items))
    except asyncio.CancelledError:
        for r, _ in items:
            state.scheduler.abort(r.rid)
        raise
    failed = next((r for r, _ in items if r.finish.get("status_code")), None)
    if failed is not None:
        raise oa.OpenAIError(failed.finish["message"], failed.finish["status_code"])
    return [server.reply(state, r, lp) for r, lp in items]


def _finish_reason(meta: dict[str, Any], has_calls: bool = False) -> str | None:
    kind = (meta.get("finish_reason") or {}).get("type")
    return "tool_calls" if has_calls and kind == "stop" else kind


def _matched(meta: dict[str, Any]) -> int | str | None:
    return (meta.get("finish_reason") or {}).get("matched")


def _shown(reply: dict[str, Any], no_stop_trim: bool) -> int:
    """How many of a reply's output tokens the text shows (a matched stop token is left out)."""
    n = len(reply["output_ids"])
    return n - 1 if n and isinstance(_matched(reply["meta_info"]), int) and not no_stop_trim else n


@functools.cache
def _token_table(model_path: str) -> TokenBytes:
    return TokenBytes(model_path)


def _token_bytes(state: EngineState) -> TokenBytes:
    """Token texts and bytes for logprobs, one table per served model (miles/chat/token_bytes.py)."""
    if state.tokenizer is None:
        raise oa.OpenAIError("this engine has no tokenizer; logprobs need one", param="logprobs")
    return _token_table(state.model_path)


def _chat_logprobs(meta: dict[str, Any], start: int, end: int, text: TokenBytes) -> oa.ChoiceLogprobs:
    rows = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [[] for _ in rows]

    def entry(lp: float | None, tok: int) -> dict[str, Any]:
        t, raw = text(tok)
        return {"token": t, "logprob": lp, "bytes": raw}

    content = [
        oa.TokenLogprob(**entry(lp, tok), top_logprobs=[oa.TopLogprob(**entry(a, b)) for a, b, *_ in top])
        for (lp, tok, *_), top in zip(rows[start:end], tops[start:end], strict=False)
    ]
    return oa.ChoiceLogprobs(content=content)


def _completion_logprobs(
    meta: dict[str, Any], start: int, end: int, text: TokenBytes, offset: int
) -> oa.CompletionLogprobs:
    rows = (meta.get("output_token_logprobs") or [])[start:end]
    tops = meta.get("output_top_logprobs")
    tokens = [text(tok)[0] for _, tok, *_ in rows]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return oa.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp for lp, *_ in rows],
        top_logprobs=[{text(b)[0]: a for a, b, *_ in top} for top in tops[start:end]]
        if tops is not None
        else None,
        text_offset=offsets,
    )


def _usage(items: Items, n: int) -> oa.Usage:
    """Usage of all choices: each prompt counts once, however many samples it has."""
    firsts = [r for i, (r, _) in enumerate(items) if i % n == 0]
    prompt = sum(len(r.prompt) for r in firsts)
    completion = sum(len(r.output) for r, _ in items)
    cached = sum(r.cached_tokens for r in firsts)
    return oa.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=cached),
    )


def _json(model: Any, drop: tuple[str, ...] = ()) -> bytes:
    data = model.model_dump(mode="json")
    for key in drop:
        data.pop(key, None)
    return pydantic_core.to_json(data, inf_nan_mode="null")


# ---------------------------------------------------------------------------------------------------
# Chat


class _Chat:
    """What a chat request needs beyond its body: the prompt, the tool-call family and its parsing."""

    def __init__(self, renderer: ChatRenderer, req: oa.ChatCompletionRequest):
        self.req = req
        self.family = renderer.family
        self.parse_tools = bool(req.tools) and req.tool_choice != "none"
        if req.input_ids is not None:
            self.prompt = list(req.input_ids)
        else:
            try:
                self.prompt = renderer.render_ids(req.messages, req.tools, True, req.chat_template_kwargs)
            except Exception as e:  # a template's raise_exception, or one that cannot take these messages
                raise oa.OpenAIError(
                    f"the chat template cannot render these messages: {e}", param="messages"
                ) from None
        self.constraint = _tool_regex(req, self.family)

    def body(self, state: EngineState) -> GenerateReqInput:
        req = self.req
        sp = _sampling(req, _max_new_tokens(state, req, len(self.prompt)))
        if self.constraint is not None:
            sp["regex"] = self.constraint
        return GenerateReqInput(
            input_ids=self.prompt,
            sampling_params=sp,
            return_logprob=req.logprobs or req.return_meta_info,
            top_logprobs_num=req.top_logprobs or 0,
            rid=req.rid,
            lora_path=lora_of(state, req),
        )

    def parse(self, text: str) -> ParsedToolCalls:
        return parse_tool_calls(text, self.family) if self.parse_tools else ParsedToolCalls(text)


def _tool_regex(req: oa.ChatCompletionRequest, family: str) -> str | None:
    """The output constraint of `tool_choice` "required" or a named function (module docstring)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "auto", "none"):
        return None
    if req.regex is not None or req.ebnf is not None or req.json_schema is not None:
        raise oa.OpenAIError(
            "tool_choice 'required' or a named function cannot be combined with regex, ebnf or json_schema",
            param="tool_choice",
        )
    names = (
        [choice.function.name]
        if isinstance(choice, oa.NamedToolChoice)
        else [t.function.name for t in req.tools]
    )
    if isinstance(choice, oa.NamedToolChoice) and choice.function.name not in {
        t.function.name for t in req.tools
    }:
        raise oa.OpenAIError(
            f"tool_choice names {choice.function.name!r}, which is not in 'tools'", param="tool_choice"
        )
    name = "(" + "|".join(re.escape(n) for n in names) + ")"
    args = r"\{[^\n]*\}"
    if FAMILIES[family] == "llama3":
        return r'\{"name": "' + name + r'", "parameters": ' + args + r"\}"
    return r'<tool_call>\n\{"name": "' + name + r'", "arguments": ' + args + r"\}\n</tool_call>"


def _chat_choice(chat: _Chat, index: int, reply: dict[str, Any], text: TokenBytes) -> oa.ChatChoice:
    req, meta = chat.req, reply["meta_info"]
    parsed = chat.parse(reply["text"])
    choice = oa.ChatChoice(
        index=index,
        message=oa.ChatMessage(content=parsed.content, tool_calls=parsed.tool_calls or None),
        finish_reason=_finish_reason(meta, bool(parsed.tool_calls)),
        matched_stop=None if parsed.tool_calls else _matched(meta),
    )
    if req.logprobs:
        choice.logprobs = _chat_logprobs(meta, 0, _shown(reply, req.no_stop_trim), text)
    if req.return_token_ids or req.return_prompt_token_ids:
        choice.prompt_token_ids = chat.prompt
    if req.return_token_ids:
        choice.response_token_ids = list(reply["output_ids"])
    if req.return_meta_info:
        choice.meta_info = meta | {"miles_malformed_tool_calls": parsed.malformed}
    if parsed.malformed:
        log.info("chat completion %s: %d malformed tool-call block(s)", meta.get("id"), parsed.malformed)
    return choice


async def chat_completions(state: EngineState, renderer: ChatRenderer, request: Request) -> Response:
    req = await _read(request, oa.ChatCompletionRequest)
    chat = _Chat(renderer, req)
    items = await _start(state, chat.body(state))
    cid = "chatcmpl-" + (req.rid or uuid.uuid4().hex)
    model = req.model or state.model_path
    if req.stream:
        return _sse(_chat_stream(state, chat, items, cid, model))
    replies = await _finish(state, items)
    text = _token_bytes(state)
    reply = oa.ChatCompletion(
        id=cid,
        model=model,
        choices=[_chat_choice(chat, i, r, text) for i, r in enumerate(replies)],
        usage=_usage(items, req.n),
    )
    return Response(_json(reply), media_type="application/json")


def _sse(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _native_chunks(state: EngineState, items: Items) -> AsyncIterator[dict[str, Any]]:
    """The native incremental stream of submitted requests, as chunk dicts carrying `index`."""
    from miles.engine import server

    box: list[dict[str, Any]] = []

    def keep(data: dict[str, Any]) -> bytes:  # streaming.events encodes each chunk: keep it as is
        box.append(data)
        return b""

    native = streaming.events(
        items,
        lambda r, lp: server.reply(state, r, lp),
        state.scheduler.abort,
        keep,
        indexed=True,
        incremental=True,
    )
    async with contextlib.aclosing(native):  # closing aborts what still runs (a client that left)
        async for raw in native:
            if raw == streaming.DONE:
                return
            yield box.pop()


def _error_event(chunk: dict[str, Any]) -> bytes:
    err = chunk["error"]
    status = err.get("code") if isinstance(err.get("code"), int) else 500
    return streaming.event(pydantic_core.to_json(oa.OpenAIError(err.get("message", ""), status).body()))


async def _chat_stream(
    state: EngineState, chat: _Chat, items: Items, cid: str, model: str
) -> AsyncIterator[bytes]:
    req = chat.req
    usage_drop = () if req.stream_options and req.stream_options.include_usage else ("usage",)
    text = _token_bytes(state)
    parsers = [ToolCallStream(chat.family) if chat.parse_tools else None for _ in items]

    def chunk(i: int, delta: oa.Delta, finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = oa.ChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)
        return streaming.event(
            _json(oa.ChatCompletionChunk(id=cid, model=model, choices=[choice]), usage_drop)
        )

    for i in range(len(items)):
        yield chunk(i, oa.Delta(role="assistant", content=""))
    async with contextlib.aclosing(_native_chunks(state, items)) as native:
        async for data in native:
            if "error" in data:
                yield _error_event(data)
                yield streaming.DONE
                return
            i, meta = data["index"], data["meta_info"]
            final = meta.get("finish_reason") is not None
            lp = None
            if req.logprobs:
                n = len(data["output_ids"]) - (
                    final and isinstance(_matched(meta), int) and not req.no_stop_trim
                )
                lp = _chat_logprobs(meta, 0, max(n, 0), text)
            content = parsers[i].feed(data["text"]) if parsers[i] else data["text"]
            if content or (lp is not None and lp.content):
                yield chunk(i, oa.Delta(content=content), logprobs=lp)
            if final:
                for part in _chat_tail(parsers[i], meta):
                    yield chunk(i, *part)
    if not usage_drop:
        usage = _usage(items, req.n)
        yield streaming.event(_json(oa.ChatCompletionChunk(id=cid, model=model, choices=[], usage=usage)))
    yield streaming.DONE


def _chat_tail(parser: ToolCallStream | None, meta: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A finished choice's last chunks: the rest of its content, its tool calls, its finish reason."""
    out: list[tuple[Any, ...]] = []
    calls: list[dict[str, Any]] = []
    if parser is not None:
        done = parser.finish()
        calls = done.tool_calls
        if done.content:
            out.append((oa.Delta(content=done.content),))
        if calls:
            deltas = [
                oa.DeltaToolCall(
                    index=k, id=c["id"], type="function", function=oa.DeltaFunction(**c["function"])
                )
                for k, c in enumerate(calls)
            ]
            out.append((oa.Delta(tool_calls=deltas),))
    out.append((oa.Delta(), _finish_reason(meta, bool(calls))))
    return out


# ---------------------------------------------------------------------------------------------------
# Completions


def _prompts(state: EngineState, prompt: Any) -> list[list[int]]:
    if prompt == [] or prompt == "":
        raise oa.OpenAIError("'prompt' is empty", param="prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], list):
        return [list(p) for p in prompt]
    if state.tokenizer is None:
        raise oa.OpenAIError("this engine has no tokenizer; send 'prompt' as token ids", param="prompt")
    return [state.tokenizer.encode(p) for p in prompt]


def lora_of(state: EngineState, req: Any) -> Any:
    """The request's LoRA adapter as SGLang resolves it: `model: "<base>:<adapter>"` (the served model
    name, or anything before the first colon, as the base) before the `lora_path` field."""
    model = req.model or ""
    if ":" in model and model != state.model_path:
        base = state.model_path if model.startswith(f"{state.model_path}:") else model.split(":", 1)[0]
        adapter = model[len(base) + 1 :].strip()
        if adapter:
            return adapter
    return req.lora_path


async def completions(state: EngineState, request: Request) -> Response:
    req = await _read(request, oa.CompletionRequest)
    prompts = _prompts(state, req.prompt)
    longest = max(len(p) for p in prompts)
    body = GenerateReqInput(
        input_ids=prompts if len(prompts) > 1 else prompts[0],
        sampling_params=_sampling(req, _max_new_tokens(state, req, longest)),
        return_logprob=req.logprobs is not None,
        top_logprobs_num=req.logprobs or 0,
        rid=req.rid,
        lora_path=lora_of(state, req),
    )
    text = _token_bytes(state) if req.logprobs is not None else None
    items = await _start(state, body)
    cid = "cmpl-" + (req.rid or uuid.uuid4().hex)
    model = req.model or state.model_path
    if req.stream:
        return _sse(_completion_stream(state, req, items, text, cid, model))
    replies = await _finish(state, items)
    choices = [_completion_choice(req, i, r, items[i][0].prompt, text) for i, r in enumerate(replies)]
    reply = oa.Completion(id=cid, model=model, choices=choices, usage=_usage(items, req.n))
    return Response(_json(reply), media_type="application/json")


def _completion_choice(
    req: oa.CompletionRequest, index: int, reply: dict[str, Any], prompt: list[int], text: TokenBytes | None
) -> oa.CompletionChoice:
    meta = reply["meta_info"]
    choice = oa.CompletionChoice(
        index=index, text=reply["text"], finish_reason=_finish_reason(meta), matched_stop=_matched(meta)
    )
    if text is not None:
        choice.logprobs = _completion_logprobs(meta, 0, _shown(reply, req.no_stop_trim), text, 0)
    if req.return_token_ids:
        choice.prompt_token_ids, choice.token_ids = prompt, list(reply["output_ids"])
    return choice


async def _completion_stream(
    state: EngineState,
    req: oa.CompletionRequest,
    items: Items,
    text: TokenBytes | None,
    cid: str,
    model: str,
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    drop = () if include_usage else ("usage",)
    offsets = [0] * len(items)
    async with contextlib.aclosing(_native_chunks(state, items)) as native:
        async for data in native:
            if "error" in data:
                yield _error_event(data)
                yield streaming.DONE
                return
            choice = _completion_chunk_choice(req, data, text, offsets)
            if choice.text or choice.finish_reason or choice.token_ids:
                yield streaming.event(_json(oa.Completion(id=cid, model=model, choices=[choice]), drop))
    if include_usage:
        usage = _usage(items, req.n)
        yield streaming.event(_json(oa.Completion(id=cid, model=model, choices=[], usage=usage)))
    yield streaming.DONE


def _completion_chunk_choice(
    req: oa.CompletionRequest, data: dict[str, Any], text: TokenBytes | None, offsets: list[int]
) -> oa.CompletionChoice:
    """One native incremental chunk as a completion stream choice (`offsets`: text offset per choice)."""
    i, meta = data["index"], data["meta_info"]
    final = meta.get("finish_reason") is not None
    choice = oa.CompletionChoice(
        index=i, text=data["text"], finish_reason=_finish_reason(meta) if final else None
    )
    if text is not None:
        n = len(data["output_ids"]) - (final and isinstance(_matched(meta), int) and not req.no_stop_trim)
        choice.logprobs = _completion_logprobs(meta, 0, max(n, 0), text, offsets[i])
        offsets[i] += sum(len(t) for t in choice.logprobs.tokens)
    if req.return_token_ids:
        choice.token_ids = list(data["output_ids"])
    return choice


# ---------------------------------------------------------------------------------------------------
# Registration


def _handled(route: Callable[..., Any]) -> Callable[..., Any]:
    """OpenAI's error body for every error of a route."""

    async def wrapped(request: Request) -> Response:
        try:
            return await route(request)
        except oa.OpenAIError as e:
            return _error_response(e)
        except HTTPError as e:
            return _error_response(_from_http(e))

    return wrapped


def add_openai_routes(app: FastAPI, state: EngineState, error: Any = None) -> None:
    """Register `/v1/chat/completions`, `/v1/completions` and `/v1/models` on the engine's app."""
    renderer = ChatRenderer(state.model_path)

    async def _chat(request: Request) -> Response:
        if state.tokenizer is None:
            raise oa.OpenAIError("this engine has no tokenizer; chat completions need one", 400)
        try:  # the first call loads the template's tokenizer (transformers): off the event loop
            await asyncio.to_thread(lambda: renderer.tokenizer)
        except ValueError as e:  # no chat template in the model directory
            raise oa.OpenAIError(str(e), param="messages") from None
        return await chat_completions(state, renderer, request)

    async def _completions(request: Request) -> Response:
        return await completions(state, request)

    async def _models(request: Request) -> Response:
        cards = [
            oa.ModelCard(
                id=state.model_path, root=state.model_path, max_model_len=state.scheduler.max_context
            )
        ]
        bank = state.scheduler.decoder.lora
        for name, source in (bank.sources if bank is not None else {}).items():  # as SGLang lists adapters
            cards.append(oa.ModelCard(id=name, root=source, parent=state.model_path, max_model_len=None))
        return Response(_json(oa.ModelList(data=cards)), media_type="application/json")

    app.add_api_route("/v1/chat/completions", _handled(_chat), methods=["POST"])
    app.add_api_route("/v1/completions", _handled(_completions), methods=["POST"])
    app.add_api_route("/v1/models", _handled(_models), methods=["GET"])
