"""SGLang's native HTTP API over the embedded engine, field for field.

Requests and replies follow sglang/srt/managers/io_struct.py and sglang/srt/entrypoints/http_server.py
so the same client (miles.rollout.client) and the sglang-router work against both. Errors are
`{"error": {"message": ...}}` with a 4xx status, as in SGLang, and never stop the engine.

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
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from miles.engine.request import Request as EngineRequest
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Scheduler
from miles.engine.updates import WeightUpdater

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A user mistake in a request: answered with 400 and this message."""


class GenerateReqInput(BaseModel):
    """The /generate body (SGLang's GenerateReqInput; fields the engine does not use are ignored)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_routed_experts: bool = False


@dataclass
class EngineState:
    """What the HTTP layer needs: the scheduler, the tokenizer and the launch settings."""

    scheduler: Scheduler
    model_path: str
    tokenizer: Any
    server_args: dict[str, Any]
    eos_token_ids: frozenset[int]
    seed: int = 0
    updater: WeightUpdater = field(init=False)

    def __post_init__(self) -> None:
        self.updater = WeightUpdater(self.scheduler, self.model_path)
        self._seed_counter = self.seed * 1_000_003

    def next_seed(self) -> int:
        self._seed_counter += 1
        return self._seed_counter


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def _body(request: Request, model: type[BaseModel] | None = None) -> Any:
    raw = await request.body()
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
        raise BadRequest(_explain(e)) from e


def _explain(e: ValidationError) -> str:
    parts = []
    for item in e.errors():
        loc = ".".join(str(p) for p in item["loc"])
        parts.append(
            f"unknown field {loc!r}" if item["type"] == "extra_forbidden" else f"{loc}: {item['msg']}"
        )
    return "; ".join(parts)


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


def _make_request(state: EngineState, prompt: list[int], params: dict, rid: str) -> EngineRequest:
    try:
        sp = SamplingParams.model_validate(params)
        sp.check_supported()
    except ValidationError as e:
        raise BadRequest("sampling_params: " + _explain(e)) from e
    except ValueError as e:
        raise BadRequest(str(e)) from e
    vocab = state.scheduler.decoder.spec.vocab_size
    if not prompt:
        raise BadRequest("the prompt is empty")
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt):
        raise BadRequest(f"input_ids must be integers in [0, {vocab})")
    if len(prompt) >= state.scheduler.max_context:
        raise BadRequest(
            f"the prompt has {len(prompt)} tokens; the context limit is {state.scheduler.max_context}"
        )
    stop = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(state.eos_token_ids))
    seed = sp.sampling_seed if sp.sampling_seed is not None else state.next_seed()
    return EngineRequest(rid=rid, prompt=list(prompt), params=sp, seed=seed, stop_ids=frozenset(stop))


def _reply(state: EngineState, req: EngineRequest, return_logprob: bool) -> dict[str, Any]:
    """SGLang's reply to one request; `output_token_logprobs` rows are (logprob, token_id, None)
    tuples, which serialise as the JSON arrays SGLang sends."""
    text = ""
    if state.tokenizer is not None:
        text = state.tokenizer.decode(req.output, skip_special_tokens=req.params.skip_special_tokens)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish,
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output),
        "cached_tokens": req.cached_tokens,
        "weight_version": req.versions[-1] if req.versions else state.scheduler.weight_version,
        "e2e_latency": time.monotonic() - req.created_s,
        "miles_output_token_weight_versions": list(req.versions),
    }
    if return_logprob:
        nones = [None] * len(req.output)
        meta["output_token_logprobs"] = list(zip(req.logprobs, req.output, nones, strict=True))
        meta["input_token_logprobs"] = []
    return {"text": text, "output_ids": list(req.output), "meta_info": meta}


def to_json(data: Any) -> bytes:
    """Compact JSON as SGLang writes it (orjson: NaN and infinities become null)."""
    return pydantic_core.to_json(data, inf_nan_mode="null")


async def generate(state: EngineState, req: GenerateReqInput) -> bytes:
    """The /generate answer as JSON bytes: one reply object, or a list of them for a batch."""
    if req.stream:
        raise BadRequest("stream=true is not supported by the embedded engine; send stream=false")
    if req.return_routed_experts:
        raise BadRequest("return_routed_experts needs an MoE model; this engine serves dense models")
    items = _items(req, state)
    reqs = [(_make_request(state, p, sp, rid), lp) for p, sp, lp, rid in items]

    async def encoded(r: EngineRequest, return_logprob: bool) -> bytes:
        return to_json(_reply(state, await asyncio.wrap_future(r.done), return_logprob))

    for r, _ in reqs:
        state.scheduler.submit(r)
    try:
        out = await asyncio.gather(*(encoded(r, lp) for r, lp in reqs))
    except asyncio.CancelledError:
        for r, _ in reqs:
            state.scheduler.abort(r.rid)
        raise
    batch = req.input_ids is not None and bool(req.input_ids) and isinstance(req.input_ids[0], list)
    return b"[" + b",".join(out) + b"]" if batch or isinstance(req.text, list) else out[0]


def build_app(state: EngineState) -> FastAPI:
    """The FastAPI application serving SGLang's routes over `state`."""
    app = FastAPI(title="miles embedded engine")
    app.state.engine = state

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error(str(exc))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def _generate(request: Request):
        body = await generate(state, await _body(request, GenerateReqInput))
        return Response(content=body, media_type="application/json")

    @app.get("/health")
    async def _health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def _health_generate():
        s = state.scheduler
        if s.paused or s.released:
            return Response(status_code=200)
        r = _make_request(state, [0], {"max_new_tokens": 1, "temperature": 0}, "health_" + uuid.uuid4().hex)
        s.submit(r)
        await asyncio.wait_for(asyncio.wrap_future(r.done), timeout=60)
        return Response(status_code=200)

    _info_routes(app, state)
    _control_routes(app, state)
    state.updater.add_routes(app, _body, error)
    return app


def _info_routes(app: FastAPI, state: EngineState) -> None:
    spec = state.scheduler.decoder.spec

    @app.get("/get_model_info")
    async def _model_info():
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": spec.arch,
            "architectures": [spec.arch],
        }

    @app.get("/get_server_info")
    async def _server_info():
        s = state.scheduler
        return {
            **state.server_args,
            "version": "miles-embedded",
            "weight_version": s.weight_version,
            "max_total_num_tokens": s.max_total_tokens,
            "internal_states": [{**s.stats(), "last_gen_throughput": 0.0}],
        }

    @app.get("/get_weight_version")
    async def _weight_version():
        return {"weight_version": state.scheduler.weight_version}


def _control_routes(app: FastAPI, state: EngineState) -> None:
    s = state.scheduler

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def _flush():
        await asyncio.to_thread(s.flush_cache)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def _abort(request: Request):
        body = await _body(request)
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object with 'rid' or 'abort_all'")
        if body.get("abort_all"):
            s.abort(None)
        elif body.get("rid"):
            s.abort(str(body["rid"]))
        else:
            raise BadRequest("give 'rid' (a request id) or 'abort_all': true")
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def _pause(request: Request):
        body = await _body(request)
        mode = (body or {}).get("mode", "abort") if isinstance(body, dict) else None
        try:
            n = await asyncio.to_thread(s.pause, mode)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        return {"success": True, "message": f"paused ({mode}); {n} requests held", "num_paused_requests": n}

    @app.post("/continue_generation")
    async def _continue():
        await asyncio.to_thread(s.resume)
        return {"success": True, "message": "generation continued"}

    @app.post("/release_memory_occupation")
    async def _release(request: Request):
        _memory_tags(await _body(request))
        await asyncio.to_thread(s.release_memory)
        return {"success": True, "message": "memory released"}

    @app.post("/resume_memory_occupation")
    async def _resume(request: Request):
        _memory_tags(await _body(request))
        await asyncio.to_thread(s.resume_memory)
        return {"success": True, "message": "memory resumed"}


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def _memory_tags(body: Any) -> None:
    """SGLang's `tags` (which memory to release or resume) are checked; the embedded engine always
    releases and resumes all of it together (its graphs hold the pool's and weights' addresses)."""
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is not None and (not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags)):
        raise BadRequest(f"tags must be a list drawn from {list(MEMORY_TAGS)} or null, got {tags!r}")


def model_path_of(model_dir: str) -> str:
    return str(Path(model_dir).resolve())
