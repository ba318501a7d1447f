"""The session server: an OpenAI chat `base_url` per episode, token in and token out.

An agent gets its own `base_url` and talks to it with any OpenAI client; every call is served by an
engine's native `/generate` (through miles.rollout.client.SGLangClient) with the session's token
prompt, and the reply tokens, log-probs and weight versions are recorded (miles/agentic/session.py
says how the prompt is built; miles/agentic/trajectory.py how the record becomes Samples).

API for the rollout loop (runs in the loop's event loop, in-process):

    server = SessionServer(clients, tokenizer_dir)    # clients: engines or one router; tokenizer=
                                                      # a loaded one (else loaded in start())
    root = await server.start()                       # "http://127.0.0.1:PORT"
    sid, base_url = server.open_session({"group_id": 3})
    ...  # the agent calls base_url + "/chat/completions" (plain or stream=true)
    samples = server.close_session(sid)               # list[miles.sample.Sample], one per branch
    await server.stop()

Routes (JSON; errors in OpenAI's body `{"error": {"message", "type", "param", "code"}}`):
- `POST /sessions` `{"metadata": {...}}` (optional) -> `{"id", "base_url"}`
- `POST /sessions/<id>/v1/subagents` `{"metadata": {...}}` (optional) -> `{"id", "base_url"}`: a sub-agent's
  session, a child of session <id> (same engine): closing the parent closes it and returns its
  samples with the parent's, as trajectories of one episode.
- `POST /sessions/<id>/v1/chat/completions`: OpenAI chat (miles.chat.openai_schema), `n`, `tools`,
  `logprobs`, `stream: true` as server-sent events. A stream carries the reply in one content chunk
  once the turn is done (the whole turn is needed to split tool calls from text).
- `GET /sessions/<id>/v1/models`, `GET /sessions/<id>` (the trajectory tree),
  `DELETE /sessions/<id>` (close; `{"id", "samples": [...]}`). An unknown id is a 404.

Bounds, so that no client (or model reply) can take the server down: a body over `max_request_bytes`
and a message whose content is over `max_message_chars` are answered 413 naming the limit; at most
`max_sessions` are open (429 beyond); a session untouched for `session_idle_timeout_s` is closed and
its samples dropped (a later call to it is a 404 saying so); the template and tokenizer run in a
worker thread, so one long prompt does not hold up another session's call. With `keys`
(miles.serving.ApiKeys) every route needs the API key.

uvicorn runs in the caller's event loop without installing signal handlers (the process keeps its
own). Engine affinity: each session is pinned to one client (round-robin at open, by index, so a
replaced `clients` list takes over); every request also carries the session id as the router's
routing key (ROUTING_KEY_HEADER) where the client supports it, so behind a `manual`-policy router
one session stays on one engine and reuses its prefix cache. A request the engine aborts (a weight
update in `abort` mode) is sent again, up to `max_attempts`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import itertools
import json
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles.agentic.session import ChatTemplate, Session, TemplateFamily, Turn, template_message
from miles.agentic.session_wire import chunks, json_body, json_reply, sample_json, sse
from miles.chat.openai_schema import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ModelCard,
    ModelList,
    OpenAIError,
    PromptTokensDetails,
    ReplyFunction,
    ReplyToolCall,
    TokenLogprob,
    Usage,
    parse_request,
)
from miles.chat.toolcalls import parse_tool_calls
from miles.rollout.client import EngineError, GenerateResult, SGLangClient
from miles.rollout.generate import parse_version
from miles.sample import Sample
from miles.serving import (
    ApiKeys,
    BodyTooLarge,
    CancelOnDisconnect,
    RequireApiKey,
    add_key_arguments,
    check_bind,
    read_limited,
)

MAX_REQUEST_BYTES = 16 * 2**20
MAX_MESSAGE_CHARS = 2 * 2**20
MAX_SESSIONS = 4096
SESSION_IDLE_TIMEOUT_S = 3600.0


class SessionServer:
    """Sessions over a set of engine clients; an HTTP app served in the caller's event loop."""

    def __init__(
        self,
        clients: list[SGLangClient],
        tokenizer_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        template_family: str | None = None,
        max_new_tokens: int = 1024,
        model_name: str | None = None,
        max_attempts: int = 4,
        tokenizer: Any = None,
        keys: ApiKeys | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_message_chars: int = MAX_MESSAGE_CHARS,
        max_sessions: int = MAX_SESSIONS,
        session_idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S,
    ):
        if not clients:
            raise ValueError("SessionServer needs at least one engine client")
        self.clients = list(clients)
        self.tokenizer_dir = str(tokenizer_dir)
        self.template_family = template_family
        self.template: ChatTemplate | None = None
        """The chat template; built here from `tokenizer`, else loaded from `tokenizer_dir` in start()."""
        if tokenizer is not None:
            self.template = ChatTemplate(tokenizer, template_family)
        self.host, self.port = host, port
        self.max_new_tokens = max_new_tokens
        self.model_name = model_name or Path(str(tokenizer_dir)).name
        self.max_attempts = max_attempts
        self.keys = keys or ApiKeys()
        self.max_request_bytes = max_request_bytes
        self.max_message_chars = max_message_chars
        self.max_sessions = max_sessions
        self.session_idle_timeout_s = session_idle_timeout_s
        self.sessions: dict[str, Session] = {}
        self._touched: dict[str, float] = {}
        """Session id -> monotonic time of its last call (idle expiry)."""
        self._expired: set[str] = set()
        self.url = ""
        self._engine: dict[str, int] = {}
        """Session id -> index of its engine in `clients` (the list may be replaced, e.g. after an
        engine was lost; a session then continues on the client now at its index)."""
        self._next = itertools.cycle(range(len(self.clients)))
        self._keyed = "routing_key" in inspect.signature(SGLangClient.generate).parameters
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._children: dict[str, list[str]] = {}
        """Sub-agent sessions by parent session id."""
        self.app = self._routes()

    # ---- in-process API ----
    async def start(self) -> str:
        """Serve on host:port (0: the OS picks); returns the URL root once requests are accepted."""
        if self.template is None:
            from transformers import AutoTokenizer

            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.tokenizer_dir)
            self.template = ChatTemplate(tokenizer, self.template_family)
        # IPPROTO_TCP named explicitly: asyncio turns Nagle's algorithm off only for sockets whose
        # proto is TCP, and with it on every reply waits ~40 ms for a delayed ACK (headers and body
        # are written separately)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        config = uvicorn.Config(
            RequireApiKey(CancelOnDisconnect(self.app), self.keys),
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None

    def open_session(
        self, metadata: dict[str, Any] | None = None, parent: str | None = None
    ) -> tuple[str, str]:
        """A new session: its id and its OpenAI base_url. With `parent`, a sub-agent's session: it is
        served by the parent's engine and closed (its samples returned) with the parent."""
        sid = uuid.uuid4().hex
        if self.template is None:
            raise RuntimeError("SessionServer.start() must run before sessions are opened")
        self.expire_idle()
        if len(self.sessions) >= self.max_sessions:
            raise OpenAIError(
                f"{len(self.sessions)} sessions are open, the server's cap (max_sessions); close one first",
                429,
                code="too_many_sessions",
            )
        if parent is not None:
            self._session(parent)
            metadata = {**(metadata or {}), "parent": parent}
            self._children.setdefault(parent, []).append(sid)
        self.sessions[sid] = Session(sid, self.template, metadata)
        self._touched[sid] = time.monotonic()
        self._engine[sid] = self._engine[parent] if parent is not None else next(self._next)
        return sid, self.base_url(sid)

    def base_url(self, sid: str) -> str:
        return f"{self.url}/sessions/{sid}/v1"

    def close_session(self, sid: str) -> list[Sample]:
        """End a session and its sub-agents' sessions; their Samples, one per branch, the session's own
        first (empty when no call was made)."""
        session = self._session(sid)
        del self.sessions[sid]
        self._engine.pop(sid, None)
        self._touched.pop(sid, None)
        samples = session.samples()
        for child in self._children.pop(sid, []):
            if child in self.sessions:
                samples += self.close_session(child)
        return samples

    def expire_idle(self) -> list[str]:
        """Close the sessions idle for longer than session_idle_timeout_s (their samples are dropped);
        their ids."""
        cutoff = time.monotonic() - self.session_idle_timeout_s
        idle = [sid for sid, t in self._touched.items() if t < cutoff]
        for sid in idle:
            self.sessions.pop(sid, None)
            self._engine.pop(sid, None)
            self._touched.pop(sid, None)
            self._children.pop(sid, None)
            self._expired.add(sid)
        return idle

    def _session(self, sid: str) -> Session:
        self.expire_idle()
        try:
            session = self.sessions[sid]
        except KeyError:
            if sid in self._expired:
                raise OpenAIError(
                    f"session {sid!r} was closed after {self.session_idle_timeout_s:g} s without a call",
                    404,
                    code="session_expired",
                ) from None
            raise OpenAIError(f"session {sid!r} not found", 404, code="session_not_found") from None
        self._touched[sid] = time.monotonic()
        return session

    # ---- HTTP ----
    def _routes(self) -> FastAPI:
        app = FastAPI(title="miles sessions", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(OpenAIError)
        async def _error(_: Request, e: OpenAIError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.post("/sessions")
        async def open_(request: Request) -> JSONResponse:
            body = await self._body(request, default={})
            meta = body.get("metadata") if isinstance(body, dict) else None
            if meta is not None and not isinstance(meta, dict):
                raise OpenAIError("'metadata' must be an object", param="metadata")
            sid, url = self.open_session(meta)
            return JSONResponse({"id": sid, "base_url": url})

        @app.post("/sessions/{sid}/v1/subagents")
        async def subagent(sid: str, request: Request) -> JSONResponse:
            body = await self._body(request, default={})
            meta = body.get("metadata") if isinstance(body, dict) else None
            if meta is not None and not isinstance(meta, dict):
                raise OpenAIError("'metadata' must be an object", param="metadata")
            child, url = self.open_session(meta, parent=sid)
            return JSONResponse({"id": child, "base_url": url})

        @app.get("/sessions/{sid}")
        async def show(sid: str) -> JSONResponse:
            s = self._session(sid)
            return JSONResponse({"id": sid, "metadata": s.metadata, "nodes": s.tree.describe()})

        @app.delete("/sessions/{sid}")
        async def close(sid: str) -> JSONResponse:
            samples = [sample_json(s) for s in self.close_session(sid)]
            return JSONResponse({"id": sid, "samples": samples})

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str) -> Response:
            self._session(sid)
            return json_reply(ModelList(data=[ModelCard(id=self.model_name, root=self.model_name)]))

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request) -> Response:
            session = self._session(sid)
            req = parse_request(ChatCompletionRequest, await self._body(request))
            return await self.chat(session, req)

        return app

    async def _body(self, request: Request, default: Any = None) -> Any:
        try:
            raw = await read_limited(
                request, self.max_request_bytes, "the session server's max_request_bytes"
            )
        except BodyTooLarge as e:
            raise OpenAIError(str(e), 413, code="request_too_large") from None
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        return json_body(raw, default)

    def _check_sizes(self, messages: list[dict[str, Any]]) -> None:
        for i, m in enumerate(messages):
            size = (
                len(json.dumps(m.get("content"), ensure_ascii=False)) if m.get("content") is not None else 0
            )
            if size > self.max_message_chars:
                raise OpenAIError(
                    f"messages[{i}] has {size} characters of content; this server takes at most "
                    f"{self.max_message_chars} per message (max_message_chars)",
                    413,
                    param=f"messages[{i}].content",
                    code="message_too_large",
                )

    async def chat(self, session: Session, req: ChatCompletionRequest) -> Response:
        """Serve one chat call of `session` and record it."""
        _check_supported(req)
        messages = [template_message(m.model_dump()) for m in req.messages]
        self._check_sizes(messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:  # in a thread: a long prompt's template and tokenizer work must not stall other sessions
            turn = await asyncio.to_thread(session.plan, messages, tools, req.chat_template_kwargs)
        except (ValueError, TypeError) as e:  # the template refused the messages
            raise OpenAIError(f"the chat template cannot render these messages: {e}") from None
        params = self._sampling(req)
        seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]
        results = await asyncio.gather(*(self._generate(session, turn, params, s) for s in seeds))
        offered = bool(tools) and req.tool_choice != "none"
        choices = [self._record(session, turn, r, i, req, offered) for i, r in enumerate(results)]
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        model = req.model or self.model_name
        usage = Usage(
            prompt_tokens=len(turn.prompt_ids),
            completion_tokens=sum(len(r.output_ids) for r in results),
            total_tokens=len(turn.prompt_ids) + sum(len(r.output_ids) for r in results),
            prompt_tokens_details=PromptTokensDetails(cached_tokens=min(r.cached_tokens for r in results)),
        )
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            stream = chunks(cid, model, choices, usage if include else None)
            return StreamingResponse(sse(stream), media_type="text/event-stream")
        return json_reply(ChatCompletion(id=cid, model=model, choices=choices, usage=usage))

    def _sampling(self, req: ChatCompletionRequest) -> dict[str, Any]:
        stop_ids = [self.template.turn_end_id] + list(req.stop_token_ids or [])
        params: dict[str, Any] = {
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "max_new_tokens": req.max_new_tokens() or self.max_new_tokens,
            "stop_token_ids": stop_ids,
            "min_new_tokens": req.min_tokens,
            "ignore_eos": req.ignore_eos,
        }
        optional = {
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
            "regex": req.regex,
            "ebnf": req.ebnf,
            "json_schema": req.json_schema,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        return params

    async def _generate(
        self, session: Session, turn: Turn, params: dict[str, Any], seed: int | None
    ) -> GenerateResult:
        client = self.clients[self._engine.get(session.id, 0) % len(self.clients)]
        params = params if seed is None else {**params, "sampling_seed": seed}
        extra = {"routing_key": session.id} if self._keyed else {}
        for _ in range(self.max_attempts):
            try:
                r = await client.generate(turn.prompt_ids, params, **extra)
            except EngineError as e:
                status = e.status if e.status is not None and 400 <= e.status < 500 else 502
                raise OpenAIError(f"engine: {e}", status, code="engine_error") from None
            if r.finish_reason != "abort":
                return r
        raise OpenAIError(
            f"the engine aborted the request {self.max_attempts} times", 503, code="engine_aborted"
        )

    def _record(
        self,
        session: Session,
        turn: Turn,
        r: GenerateResult,
        index: int,
        req: ChatCompletionRequest,
        offered: bool,
    ) -> ChatChoice:
        family = self.template.family
        ids = (
            r.output_ids[:-1]
            if r.output_ids and r.output_ids[-1] == self.template.turn_end_id
            else r.output_ids
        )
        text = _decode(self.template.tokenizer, ids)
        reply = parse_reply(text, family, offered)
        versions = [parse_version(v) for v in r.weight_versions]
        session.record(turn, r.output_ids, r.logprobs, versions, reply, r.finish_reason)
        calls = [
            ReplyToolCall(id=c["id"], function=ReplyFunction(**c["function"]))
            for c in reply.get("tool_calls", [])
        ]
        finish = "tool_calls" if calls and r.finish_reason == "stop" else r.finish_reason
        message = ChatMessage(
            content=reply["content"],
            tool_calls=calls or None,
            reasoning_content=reply.get("reasoning_content"),
        )
        choice = ChatChoice(index=index, message=message, finish_reason=finish)
        if req.logprobs:
            choice.logprobs = self._logprobs(r)
        if req.return_token_ids:
            choice.prompt_token_ids, choice.response_token_ids = list(turn.prompt_ids), list(r.output_ids)
        if req.return_meta_info:
            choice.meta_info = r.meta_info
        return choice

    def _logprobs(self, r: GenerateResult) -> ChoiceLogprobs:
        tok = self.template.tokenizer
        content = []
        for tid, lp in zip(r.output_ids, r.logprobs, strict=False):
            token = tok.decode([tid])
            lp_out = None if lp != lp else lp  # NaN: SGLang writes null
            content.append(
                TokenLogprob(token=token, logprob=lp_out, bytes=list(token.encode()), top_logprobs=[])
            )
        return ChoiceLogprobs(content=content)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: it runs inside the caller's process, whose
    SIGINT/SIGTERM handling (graceful stop, requeue) must stay the caller's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# ---- replies ----


def parse_reply(text: str, family: TemplateFamily, tools_offered: bool) -> dict[str, Any]:
    """The assistant message of a reply text: content, `reasoning_content` (thinking families) and
    `tool_calls` (when tools were offered; miles.chat.toolcalls). A malformed call stays in the
    content."""
    reply: dict[str, Any] = {"role": "assistant"}
    if family.thinks and "</think>" in text:
        reasoning, _, text = text.partition("</think>")
        reply["reasoning_content"] = reasoning.replace("<think>", "", 1).strip("\n")
        text = text.lstrip("\n")
    if not tools_offered:
        reply["content"] = text
        return reply
    parsed = parse_tool_calls(text, family.name)
    reply["content"] = parsed.content
    if parsed.tool_calls:
        reply["tool_calls"] = parsed.tool_calls
    if parsed.malformed:
        reply["malformed_tool_calls"] = parsed.malformed  # recorded, not sent to the client
    return reply


def _decode(tokenizer: Any, ids: list[int]) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=True)


def _check_supported(req: ChatCompletionRequest) -> None:
    if req.input_ids is not None:
        raise OpenAIError("'input_ids' is not accepted: the session builds the prompt", param="input_ids")
    if req.top_logprobs:
        raise OpenAIError("'top_logprobs' is not supported by the session server", param="top_logprobs")
    if req.logit_bias:
        raise OpenAIError("'logit_bias' is not supported by the session server", param="logit_bias")


# ---- standalone ----


def main(argv: list[str] | None = None) -> None:
    """`python -m miles.agentic.session_server --engine URL --tokenizer DIR`: sessions over engines."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", required=True, help="engine or router URL (repeatable)")
    p.add_argument("--tokenizer", required=True, help="model directory with the tokenizer and chat template")
    p.add_argument("--template-family", default=None, help="chatml, qwen3 or llama3 (default: detected)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--url-file", default=None)
    p.add_argument(
        "--lora-path", default=None, help="LoRA adapter every generation runs with (default: none)"
    )
    p.add_argument(
        "--max-sessions", type=int, default=MAX_SESSIONS, help="open sessions at most (429 beyond)"
    )
    p.add_argument(
        "--session-idle-timeout-s",
        type=float,
        default=SESSION_IDLE_TIMEOUT_S,
        help="a session without a call for this long is closed",
    )
    p.add_argument(
        "--engine-api-key-file", default=None, help="file with the engines' API key (sent to them)"
    )
    add_key_arguments(p)
    args = p.parse_args(argv)
    try:
        keys = ApiKeys.from_files(args.api_key_file, args.admin_api_key_file)
        engine_keys = ApiKeys.from_files(args.engine_api_key_file, None)
        check_bind("miles.agentic.session_server", args.host, keys, args.allow_unauthenticated)
    except ValueError as e:
        raise SystemExit(f"miles.agentic.session_server: {e}") from None

    async def serve() -> None:
        clients = [SGLangClient(u, keys=engine_keys) for u in args.engine]
        for c in clients:
            c.lora_path = args.lora_path
        server = SessionServer(
            clients,
            args.tokenizer,
            host=args.host,
            port=args.port,
            template_family=args.template_family,
            keys=keys,
            max_sessions=args.max_sessions,
            session_idle_timeout_s=args.session_idle_timeout_s,
        )
        url = await server.start()
        if args.url_file:
            Path(args.url_file).write_text(json.dumps({"url": url}))
        print(f"serving at {url}", flush=True)
        await server._task

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1:])
