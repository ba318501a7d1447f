"""Request checking for the engine's HTTP API: bounded body reading, JSON parsing, the /generate
body's schema, and messages that name the offending field.

Everything a request can carry is checked here, before a request reaches the engine thread:
integers fit in int64, floats are finite, sampling parameters are within SGLang's ranges and token
ids within the vocabulary (miles/engine/sampling.py holds the sampling schema). A body larger than
`--max-request-bytes` is answered 413 before it is parsed: a declared Content-Length is checked
first, a chunked body is counted while it is read. A body up to `miles.serving.DRAIN_FACTOR` times the limit is
read to its end and dropped (so the client, still sending, gets the answer instead of a reset
connection); a larger one is answered at once and the connection closed.
"""

from __future__ import annotations

from typing import Any

import pydantic_core
from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from miles.engine.sampling import Int64, SamplingParams
from miles.serving import BodyTooLarge, read_limited

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


class HTTPError(Exception):
    """An answer other than success: `{"error": {"message": ...}}` with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class BadRequest(HTTPError, ValueError):
    """A user mistake in a request: answered with 400 and this message."""

    def __init__(self, message: str):
        super().__init__(400, message)


class GenerateReqInput(BaseModel):
    """The /generate body (SGLang's GenerateReqInput; fields the engine does not use are ignored)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: Int64 | list[Int64] | None = None
    top_logprobs_num: Int64 | list[Int64] | None = None
    token_ids_logprob: list[Int64] | list[list[Int64]] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: Int64 = 0
    lora_path: str | list[str | None] | None = None


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most `limit` bytes; HTTPError 413 beyond (module docstring)."""
    try:
        return await read_limited(request, limit, "the engine's --max-request-bytes")
    except BodyTooLarge as e:
        raise HTTPError(413, str(e)) from None
    except ValueError as e:
        raise BadRequest(str(e)) from None


async def parse_body(request: Request, model: type[BaseModel] | None = None) -> Any:
    """The JSON body (size-limited by `request.app.state.max_request_bytes`), validated by `model`."""
    raw = await read_body(request, request.app.state.max_request_bytes)
    if not raw:
        data: Any = {}
    else:
        try:
            data = pydantic_core.from_json(raw)
        except ValueError as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from e
    if model is None:
        return data
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(explain(e)) from e


def explain(e: ValidationError, prefix: str = "") -> str:
    """One line per error, each naming the field as a dotted path (`sampling_params.top_p: ...`)."""
    parts = []
    for item in e.errors():
        loc = prefix + ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            parts.append(f"{loc}: {item['msg']}")
    return "; ".join(parts)


def sampling_params(params: Any, label: str = "sampling_params") -> SamplingParams:
    """Checked SamplingParams from one request's `sampling_params`; errors name `label.field`."""
    if not isinstance(params, dict):
        raise BadRequest(f"{label} must be a JSON object, got {type(params).__name__}")
    try:
        sp = SamplingParams.model_validate(params)
    except ValidationError as e:
        raise BadRequest(explain(e, label + ".")) from e
    try:
        sp.check_supported()
    except ValueError as e:
        raise BadRequest(str(e)) from e
    return sp


def check_prompt(prompt: list[int], vocab: int, max_context: int, label: str = "input_ids") -> None:
    """Token ids within the vocabulary, and a prompt that leaves room for one output token."""
    if not prompt:
        raise BadRequest(f"{label}: the prompt is empty")
    bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"{label} must be integers in [0, {vocab}), got {bad!r}")
    if len(prompt) >= max_context:
        raise BadRequest(f"{label}: the prompt has {len(prompt)} tokens; the context limit is {max_context}")
