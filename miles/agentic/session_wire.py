"""The session server's wire format: request bodies, JSON replies, Samples as JSON, and a finished
turn as OpenAI's stream of chunks (server-sent events). No state: miles/agentic/session_server.py
calls these."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from fastapi.responses import Response

from miles.chat.openai_schema import (
    ChatChoice,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    OpenAIError,
    Usage,
)
from miles.sample import Sample


def json_body(raw: bytes, default: Any = None) -> Any:
    if not raw.strip():
        if default is not None:
            return default
        raise OpenAIError("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise OpenAIError(f"the request body is not JSON: {e}") from None


def json_reply(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def sample_json(s: Sample) -> dict[str, Any]:
    out = dataclasses.asdict(s)
    out["status"] = s.status.value
    return json.loads(json.dumps(out, default=str))


def chunks(cid: str, model: str, choices: list[ChatChoice], usage: Usage | None) -> list[ChatCompletionChunk]:
    """The stream of finished choices: role, reasoning, content, tool calls, then the finish reason."""
    created = int(time.time())
    out = []

    def chunk(index: int, delta: Delta, finish: Any = None, logprobs: Any = None) -> None:
        choice = ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        out.append(ChatCompletionChunk(id=cid, created=created, model=model, choices=[choice]))

    for c in choices:
        m = c.message
        chunk(c.index, Delta(role="assistant", content=""))
        if m.reasoning_content:
            chunk(c.index, Delta(reasoning_content=m.reasoning_content))
        if m.content:
            chunk(c.index, Delta(content=m.content), logprobs=c.logprobs)
        for i, call in enumerate(m.tool_calls or []):
            fn = DeltaFunction(name=call.function.name, arguments=call.function.arguments)
            chunk(
                c.index, Delta(tool_calls=[DeltaToolCall(index=i, id=call.id, type="function", function=fn)])
            )
        chunk(c.index, Delta(), finish=c.finish_reason)
    if usage is not None:
        out.append(ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=usage))
    return out


async def sse(chunks: list[ChatCompletionChunk]):
    for c in chunks:
        yield f"data: {c.model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"
