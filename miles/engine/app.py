"""The embedded engine's HTTP application: SGLang's native routes (miles/engine/server.py for
/generate, miles/engine/routes.py for information and control, miles/engine/updates.py for weight
updates), OpenAI's (miles/engine/openai_routes.py) and the health checks, on one FastAPI app.

Health, as SGLang: `/health` and `/health_generate` answer 503 with a message when the engine
thread is dead, stopped or stuck (miles/engine/engine_thread.py); `/health_generate` also runs a
one-token generation (`/health` does not: it is SGLang's with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
off, cheap enough to poll) and answers 503 when it fails or takes longer than `health_generate_timeout_s`
(SGLang's 20 s); an engine that makes progress on other requests meanwhile is healthy. While the
engine is paused or its memory released, no generation runs and the thread's state decides. An
unhealthy engine answers new /generate requests 503 at once.

With `--enable-fault-injection`, `POST /debug/inject_fault` `{"kind": "step_error" | "step_hang" |
"scheduler_death", "seconds": ...}` arms a fault in the engine thread, for tests; without the flag
the route does not exist.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from miles.engine import server
from miles.engine.engine_thread import FAULT_KINDS
from miles.engine.openai_routes import add_openai_routes
from miles.engine.routes import add_routes
from miles.engine.server import EngineState, error, generate, generate_stream
from miles.engine.validation import GenerateReqInput, HTTPError, parse_body

log = logging.getLogger(__name__)


def build_app(state: EngineState) -> FastAPI:
    """The FastAPI application serving SGLang's routes over `state`."""
    app = FastAPI(title="miles embedded engine")
    app.state.engine = state
    app.state.max_request_bytes = state.max_request_bytes

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return error(str(exc), exc.status)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error(f"{request.url.path} failed: {type(exc).__name__}: {exc}", 500)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def _generate(request: Request):
        body = await parse_body(request, GenerateReqInput)
        if body.stream:
            return StreamingResponse(generate_stream(state, body), media_type="text/event-stream")
        return Response(content=await generate(state, body), media_type="application/json")

    @app.get("/health")
    async def _health():
        problem = state.scheduler.health_problem()
        return error(problem, 503) if problem else Response(status_code=200)

    @app.get("/health_generate")
    async def _health_generate():
        s = state.scheduler
        problem = s.health_problem()
        if problem is None and not (s.paused or s.released):
            problem = await _one_token(state)
        if problem is not None:
            log.warning("health_generate: %s", problem)
            return error(problem, 503)
        return Response(status_code=200)

    add_routes(app, state, error)
    add_openai_routes(app, state, error)
    state.updater.add_routes(app, parse_body, error)
    if state.enable_fault_injection:
        _fault_routes(app, state)
    return app


async def _one_token(state: EngineState) -> str | None:
    """SGLang's health generation: one greedy token from prompt [0]. None (healthy) when it finishes,
    or when the engine records tokens of other requests meanwhile (a busy engine is alive); else why not."""
    s = state.scheduler
    r = server.make_request(
        state, [0], {"max_new_tokens": 1, "temperature": 0}, "HEALTH_CHECK_" + uuid.uuid4().hex
    )
    before = s.num_token_steps
    s.submit(r)
    done = asyncio.wrap_future(r.done)
    deadline = time.monotonic() + state.health_generate_timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(asyncio.shield(done), timeout=0.2)
            except TimeoutError:
                if s.num_token_steps != before and s.health_problem() is None:
                    return None
                continue
            if r.finish.get("status_code"):
                return f"the health check's one-token generation failed: {r.finish['message']}"
            return None
        return (
            "the health check's one-token generation did not finish within "
            f"{state.health_generate_timeout_s:g} s"
        )
    finally:
        if not r.done.done():
            s.abort(r.rid)


class InjectFault(BaseModel):
    """The /debug/inject_fault body."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal[FAULT_KINDS]  # type: ignore[valid-type]
    seconds: float = Field(0.0, ge=0.0, le=3600.0)
    """How long a step_hang step sleeps."""


def _fault_routes(app: FastAPI, state: EngineState) -> None:
    """Tests only (--enable-fault-injection): arm a fault in the engine thread (engine_thread.py)."""
    s = state.scheduler

    @app.post("/debug/inject_fault")
    async def _inject(request: Request):
        body = await parse_body(request, InjectFault)
        log.warning("injecting fault %s (seconds=%g)", body.kind, body.seconds)
        s.inject_fault(body.kind, body.seconds)
        if body.kind == "scheduler_death":  # answer once it has struck, so callers see its effect
            deadline = time.monotonic() + 10.0
            while s.failure is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        return {"success": True, "message": f"fault {body.kind} armed"}
