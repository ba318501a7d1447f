"""The engine's control and information routes, with SGLang's names, bodies and reply shapes.

As sglang/srt/entrypoints/http_server.py: `/model_info` and `/server_info` (the older `/get_model_info`
and `/get_server_info` answer the same), `/ready`, `/tokenize` and `/detokenize` (also under `/v1/`,
SGLang's OpenAI-style bodies: `prompt` a string or a list of them, `tokens` a list of ids or a list
of such lists), `/abort_request` (by `rid`, or `abort_all`; an empty body or an unknown rid is a
no-op 200, as SGLang's), `/pause_generation` and `/continue_generation` (`"status": "ok"`),
`/flush_cache`, memory release and resume. Weight-update routes are miles/engine/updates.py.

Every body is checked with a closed schema: a malformed or unknown field is a 400 naming it, and
never reaches the engine thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from miles.engine.validation import BadRequest, parse_body

if TYPE_CHECKING:
    from miles.engine.server import EngineState

INT64_MAX = 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class AbortReqInput(_Body):
    """SGLang's AbortReq: `rid` (empty: nothing) or `abort_all`."""

    rid: StrictStr | None = ""
    abort_all: StrictBool = False


class PauseReqInput(_Body):
    """SGLang's PauseGenerationReqInput."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueReqInput(_Body):
    """SGLang's ContinueGenerationReqInput: `torch_empty_cache` returns the allocator's cached blocks
    to the driver before generation continues."""

    torch_empty_cache: StrictBool = True


class TokenizeReqInput(_Body):
    """SGLang's TokenizeRequest (`messages`, a chat to render, is not taken: send `prompt`)."""

    model: StrictStr | None = None
    prompt: StrictStr | list[StrictStr]
    add_special_tokens: StrictBool = True


class DetokenizeReqInput(_Body):
    """SGLang's DetokenizeRequest."""

    model: StrictStr | None = None
    tokens: list[StrictInt] | list[list[StrictInt]]
    skip_special_tokens: StrictBool = True


class MemoryReqInput(_Body):
    """SGLang's Release/ResumeMemoryOccupationReqInput; the engine always moves all memory together
    (its graphs hold the pool's and weights' addresses), so `tags` are checked, not chosen from."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


def hf_config(model_path: str) -> dict[str, Any]:
    """The model directory's config.json ({} when absent or unreadable)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def add_routes(app: FastAPI, state: EngineState, error) -> None:
    """Every route of this module on `app`; `error(message, status)` builds an error reply."""
    _info_routes(app, state, error)
    _tokenizer_routes(app, state)
    _control_routes(app, state)


def _info_routes(app: FastAPI, state: EngineState, error) -> None:
    started_s = time.time()

    def model_info() -> dict[str, Any]:
        path = state.updater.model_path  # follows update_weights_from_disk
        cfg = hf_config(path)
        return {
            "model_path": path,
            "served_model_name": path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.get("model_type"),
            "architectures": cfg.get("architectures") or [state.scheduler.decoder.spec.arch],
        }

    def server_info() -> dict[str, Any]:
        s = state.scheduler
        return {
            **state.server_args,
            "context_length": s.max_context,
            "max_total_num_tokens": s.max_total_tokens,
            "max_req_input_len": s.max_context - 1,
            "weight_version": s.weight_version,
            "startup_time": started_s,
            "internal_states": [{**s.stats(), "last_gen_throughput": 0.0}],
            "version": "miles-embedded",
        }

    for route, fn in (("model_info", model_info), ("server_info", server_info)):
        app.add_api_route(f"/{route}", fn, methods=["GET"])
        app.add_api_route(f"/get_{route}", fn, methods=["GET"])

    @app.get("/get_weight_version")
    async def _weight_version():
        return {"weight_version": state.scheduler.weight_version}

    @app.get("/ready")
    async def _ready():
        problem = state.scheduler.health_problem()
        return error(problem, 503) if problem else Response(status_code=200)


def _max_model_len(state: EngineState) -> int:
    """SGLang's: the tokenizer's model_max_length when it is a sane integer, else the context length."""
    n = getattr(state.tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n <= INT64_MAX else state.scheduler.max_context


def _tokenizer_routes(app: FastAPI, state: EngineState) -> None:
    def codec():
        if state.tokenizer is None:
            raise BadRequest("this engine has no tokenizer (no tokenizer.json in the model directory)")
        return state.tokenizer

    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeReqInput)
        tok = codec()
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        ids = [tok.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts]
        single = isinstance(body.prompt, str)
        return {
            "tokens": ids[0] if single else ids,
            "count": len(ids[0]) if single else [len(i) for i in ids],
            "max_model_len": _max_model_len(state),
        }

    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeReqInput)
        tok = codec()
        vocab = state.scheduler.decoder.spec.vocab_size
        lists = [body.tokens] if not body.tokens or isinstance(body.tokens[0], int) else body.tokens
        for i, ids in enumerate(lists):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                at = "" if lists[0] is body.tokens else f"[{i}]"
                raise BadRequest(f"tokens{at} must be integers in [0, {vocab}), got {bad}")
        texts = [tok.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]
        return {"text": texts[0] if lists[0] is body.tokens else texts}

    for prefix in ("", "/v1"):
        app.add_api_route(prefix + "/tokenize", tokenize, methods=["POST"])
        app.add_api_route(prefix + "/detokenize", detokenize, methods=["POST"])


def _control_routes(app: FastAPI, state: EngineState) -> None:
    s = state.scheduler

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def _flush():
        await asyncio.to_thread(s.holdings.flush_cache)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def _abort(request: Request):
        body = await parse_body(request, AbortReqInput)
        if body.abort_all:
            s.abort(None)
        elif body.rid:  # SGLang ignores an empty rid (it would match every request by prefix)
            s.abort(body.rid)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def _pause(request: Request):
        body = await parse_body(request, PauseReqInput)
        n = await asyncio.to_thread(s.pause, body.mode)
        return {
            "message": "Generation paused successfully.",
            "status": "ok",
            "success": True,
            "num_paused_requests": n,
        }

    @app.post("/continue_generation")
    async def _continue(request: Request):
        body = await parse_body(request, ContinueReqInput)
        if body.torch_empty_cache and torch.cuda.is_available():
            await asyncio.to_thread(torch.cuda.empty_cache)
        await asyncio.to_thread(s.resume)
        return {"message": "Generation continued successfully.", "status": "ok", "success": True}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def _release(request: Request):
        await parse_body(request, MemoryReqInput)
        await asyncio.to_thread(s.holdings.release_memory)
        return {"success": True, "message": "memory released"}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def _resume(request: Request):
        await parse_body(request, MemoryReqInput)
        await asyncio.to_thread(s.holdings.resume_memory)
        return {"success": True, "message": "memory resumed"}
