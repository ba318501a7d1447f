"""SGLang's native HTTP API over the embedded engine, field for field.

Requests and replies follow sglang/srt/managers/io_struct.py and sglang/srt/entrypoints/http_server.py
so the same client (miles.rollout.client) and the sglang-router work against both. Errors are
`{"error": {"message": ...}}` with a 4xx status, as in SGLang, and never stop the engine; every
field is checked before a request reaches the engine thread (miles/engine/validation.py). A request
failed by the engine (a step that raised) is answered 500 with the error, as SGLang answers an abort
that carries a status code.

`stream: true` answers with SGLang's server-sent events (miles/engine/streaming.py). Length and
identity rules are SGLang's: a prompt as long as the context, or prompt + an explicit `max_new_tokens`
over it, is a 400 with SGLang's message; a `rid` repeated inside one request or equal to one in flight
is a 400. Abort finish reasons carry `status_code` and `err_type` (null unless the engine failed the
request). Control and information routes are miles/engine/routes.py; the application that serves
all of them, with health checks, is miles/engine/app.py.

Miles-specific addition: `meta_info["miles_output_token_weight_versions"]`, the weight version that
produced each output token (one entry per token of `output_ids`). With in_place pauses a request
can span several versions; `meta_info["weight_version"]` is the version of its last token.

Replies are serialised with pydantic_core's Rust encoder, one request at a time as each finishes
(a batch reply is those encodings joined), so the event loop holds the GIL for a few milliseconds per
request rather than for a whole batch, and the engine thread keeps stepping. A non-finite log-prob
is written as `null`, as SGLang's orjson does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic_core
from fastapi.responses import JSONResponse

from miles.engine import intake, replies, streaming
from miles.engine.request import Request as EngineRequest
from miles.engine.scheduler import Scheduler
from miles.engine.updates import WeightUpdater
from miles.engine.validation import (
    DEFAULT_MAX_REQUEST_BYTES,
    BadRequest,
    GenerateReqInput,
    HTTPError,
    check_prompt,
    sampling_params,
)


@dataclass
class EngineState:
    """What the HTTP layer needs: the scheduler, the tokenizer and the launch settings."""

    scheduler: Scheduler
    model_path: str
    tokenizer: Any
    server_args: dict[str, Any]
    eos_token_ids: frozenset[int]
    seed: int = 0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    health_generate_timeout_s: float = 20.0
    enable_fault_injection: bool = False
    incremental_streaming_output: bool = False
    updater: WeightUpdater = field(init=False)
    live_rids: dict[str, int] = field(default_factory=dict)
    """rid -> number of its requests not yet finished (event-loop thread only)."""

    def __post_init__(self) -> None:
        self.updater = WeightUpdater(self.scheduler, self.model_path)
        self.server_args.setdefault("incremental_streaming_output", self.incremental_streaming_output)
        self._seed_counter = self.seed * 1_000_003

    def next_seed(self) -> int:
        self._seed_counter += 1
        return self._seed_counter


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _items(req: GenerateReqInput, state: EngineState) -> list[tuple[list[int], dict, bool, str]]:
    """Normalise single and batch forms into (input_ids, sampling_params, return_logprob, rid) items."""
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if req.input_ids is not None:
        batch = req.input_ids if req.input_ids and isinstance(req.input_ids[0], list) else None
        prompts = batch if batch is not None else [req.input_ids]
    else:
        if state.tokenizer is None:
            raise BadRequest("this engine has no tokenizer; send 'input_ids' instead of 'text'")
        texts = [req.text] if isinstance(req.text, str) else req.text
        batch = None if isinstance(req.text, str) else texts
        prompts = [state.tokenizer.encode(t) for t in texts]
    n = len(prompts)

    def per_item(value: Any, default: Any, name: str) -> list[Any]:
        if isinstance(value, list) and batch is not None:
            if len(value) != n:
                raise BadRequest(f"'{name}' has {len(value)} entries for a batch of {n}")
            return value
        if isinstance(value, list) and name != "sampling_params":
            raise BadRequest(f"'{name}' is a list but the input is a single prompt")
        return [value if value is not None else default] * n

    params = per_item(req.sampling_params, {}, "sampling_params")
    logprob = per_item(req.return_logprob, False, "return_logprob")
    if isinstance(req.rid, str) and batch is not None:
        rids = [f"{req.rid}_{i}" for i in range(n)]
    else:
        rids = [r or uuid.uuid4().hex for r in per_item(req.rid, None, "rid")]
    return list(zip(prompts, params, logprob, rids, strict=True))


def make_request(
    state: EngineState, prompt: list[int], params: Any, rid: str, index: int | None = None
) -> EngineRequest:
    at = "" if index is None else f"[{index}]"
    sp = sampling_params(params, "sampling_params" + at)
    explicit = sp.max_new_tokens if params.get("max_new_tokens") is not None else None  # 1e9 -> 10**9
    check_context_length(len(prompt), explicit, state.scheduler.max_context)
    check_prompt(
        prompt, state.scheduler.decoder.spec.vocab_size, state.scheduler.max_context, "input_ids" + at
    )
    seed = sp.sampling_seed if sp.sampling_seed is not None else state.next_seed()
    stop = intake.stop_ids(sp, state.eos_token_ids)
    return EngineRequest(rid=rid, prompt=list(prompt), params=sp, seed=seed, stop_ids=stop)


def reply(state: EngineState, req: EngineRequest, return_logprob: bool) -> dict[str, Any]:
    """SGLang's reply to one request; `output_token_logprobs` rows are (logprob, token_id, None)
    tuples, which serialise as the JSON arrays SGLang sends."""
    done = req.done.done()  # routed experts are final only once the request is (set just before done)
    text = replies.reply_text(state.tokenizer, req)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": finish_reason_json(req.finish),
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output),
        "cached_tokens": req.cached_tokens,
        "weight_version": req.versions[-1] if req.versions else state.scheduler.weight_version,
        "e2e_latency": time.monotonic() - req.created_s,
        "miles_output_token_weight_versions": list(req.versions),
    }
    if state.scheduler.speculator is not None:  # SGLang's speculative counters
        meta |= {
            "spec_verify_ct": req.spec_verify_ct,
            "spec_draft_token_num": req.spec_draft_token_num,
            "spec_accept_token_num": req.spec_accept_token_num,
        }
    if return_logprob:
        meta |= replies.logprob_meta(state.tokenizer, req)
    if done:
        meta |= replies.routed_meta(req)
    return {"text": text, "output_ids": list(req.output), "meta_info": meta}


def to_json(data: Any) -> bytes:
    """Compact JSON as SGLang writes it (orjson: NaN and infinities become null)."""
    return pydantic_core.to_json(data, inf_nan_mode="null")


def check_context_length(num_input: int, max_new_tokens: Any, context_len: int) -> None:
    """SGLang's length rule (tokenizer_manager._validate_one_request), with its messages: the prompt
    must be shorter than the context, and prompt + an explicit max_new_tokens must fit in it."""
    if num_input >= context_len:
        raise BadRequest(
            f"The input ({num_input} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    if isinstance(max_new_tokens, int) and num_input + max_new_tokens > context_len:
        raise BadRequest(
            "Requested token count exceeds the model's maximum context length "
            f"of {context_len} tokens. You requested a total of {num_input + max_new_tokens} "
            f"tokens: {num_input} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )


def finish_reason_json(finish: dict[str, Any] | None) -> dict[str, Any] | None:
    """SGLang's finish reason: an abort always carries `status_code` and `err_type` (null for an abort
    asked for by a client, a pause or a weight update; set when the engine failed the request)."""
    if finish is None or finish.get("type") != "abort":
        return finish
    return {"status_code": None, "err_type": None} | finish


def _claim_rids(state: EngineState, reqs: list[EngineRequest]) -> None:
    """SGLang's identity rule: a rid may not repeat inside one request nor match one in flight.
    Claimed rids are released as their requests finish."""
    seen: set[str] = set()
    for r in reqs:
        if r.rid in seen or r.rid in state.live_rids:
            raise BadRequest(f"Duplicate request ID detected: {r.rid}")
        seen.add(r.rid)

    def release(rid: str) -> None:
        left = state.live_rids.pop(rid, 1) - 1
        if left > 0:
            state.live_rids[rid] = left

    for r in reqs:
        state.live_rids[r.rid] = state.live_rids.get(r.rid, 0) + 1
        asyncio.wrap_future(r.done).add_done_callback(lambda _, rid=r.rid: release(rid))


def _batch_form(req: GenerateReqInput) -> bool:
    """Whether the body is SGLang's batch form (a list of prompts): the reply is then a list."""
    listed = isinstance(req.text, list) or bool(req.input_ids) and isinstance(req.input_ids[0], list)
    return listed or _n(req) > 1


def _n(req: GenerateReqInput) -> int:
    """SGLang's parallel sample count (`sampling_params.n`); a single prompt with n > 1 answers a list."""
    sp = req.sampling_params
    first = sp[0] if isinstance(sp, list) and sp else sp
    n = first.get("n", 1) if isinstance(first, dict) else 1
    return n if isinstance(n, int) else 1


def prepare(state: EngineState, req: GenerateReqInput) -> list[tuple[EngineRequest, bool]]:
    """Checked engine requests and their return_logprob flags, rids claimed; not yet submitted."""
    items = _items(req, state)
    batch = len(items) > 1 or isinstance(req.text, list) or isinstance(req.sampling_params, list)
    reqs = [
        (make_request(state, p, sp, rid, i if batch else None), lp)
        for i, (p, sp, lp, rid) in enumerate(items)
    ]
    reqs, prefills = intake.attach_options(state, req, reqs)
    problem = state.scheduler.health_problem()
    if problem is not None:
        raise HTTPError(503, problem)
    _claim_rids(state, [r for r, _ in reqs])
    for r in prefills:  # n > 1: each prompt's prefill-only request goes first (miles/engine/intake.py)
        state.scheduler.submit(r)
    return reqs


async def generate(state: EngineState, req: GenerateReqInput) -> bytes:
    """The /generate answer as JSON bytes: one reply object, or a list of them for a batch."""
    await intake.precompile(state, req)
    reqs = prepare(state, req)

    async def encoded(r: EngineRequest, return_logprob: bool) -> bytes:
        await asyncio.wrap_future(r.done)
        if r.finish.get("status_code"):  # failed by the engine, not by the client: no reply object
            raise HTTPError(r.finish["status_code"], r.finish["message"])
        return to_json(reply(state, r, return_logprob))

    for r, _ in reqs:
        state.scheduler.submit(r)
    try:
        out = await asyncio.gather(*(encoded(r, lp) for r, lp in reqs))
    except (asyncio.CancelledError, HTTPError):
        for r, _ in reqs:
            state.scheduler.abort(r.rid)
        raise
    return b"[" + b",".join(out) + b"]" if _batch_form(req) else out[0]


async def generate_stream(state: EngineState, req: GenerateReqInput) -> AsyncIterator[bytes]:
    """The /generate answer with `stream: true`: SGLang's server-sent events (miles/engine/streaming.py)."""
    try:
        await intake.precompile(state, req)
        reqs = prepare(state, req)
    except HTTPError as e:
        yield streaming.event(to_json(streaming.error_payload(str(e), e.status)))
        yield streaming.DONE
        return
    for r, _ in reqs:
        state.scheduler.submit(r)
    async for chunk in streaming.events(
        reqs,
        lambda r, lp: reply(state, r, lp),
        state.scheduler.abort,
        to_json,
        indexed=_batch_form(req) or len(reqs) > 1,
        incremental=state.incremental_streaming_output,
    ):
        yield chunk


def model_path_of(model_dir: str) -> str:
    return str(Path(model_dir).resolve())
