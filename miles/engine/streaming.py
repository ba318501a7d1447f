"""`stream: true` on /generate: SGLang's server-sent events.

Each event is `data: {json}\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. A chunk has SGLang's
reply shape (`text`, `output_ids`, `meta_info`); `meta_info.finish_reason` is null until the
request's last chunk, `completion_tokens` counts the tokens so far, and `output_token_logprobs`
(when asked for) covers them. A batch (a list of prompts, or `n > 1`) interleaves its requests'
chunks, each carrying its request's `index`, as SGLang's tokenizer manager does.

By default text, ids and per-token log-probs are cumulative (each chunk repeats everything so far;
the last chunk equals the non-streamed reply), as SGLang's default. With the engine flag
`--incremental-streaming-output` each chunk carries only what is new since the request's previous
chunk, and concatenating the chunks gives the non-streamed reply. Text that ends inside a multi-byte
character is held back until the character is complete, and so is a tail that could still become a
stop string (which the final reply trims), so every chunk's text is a prefix of the final text.

An error before or while streaming is one event `{"error": {"message", "type", "code", "retryable"}}`
followed by `[DONE]`, with HTTP 200 (as SGLang, whose request checks run inside the stream); only a
malformed body is refused with a 400 before the stream starts. A request that the engine fails
(an abort with a `status_code`) ends with its abort chunk. A client that disconnects aborts the
requests it had in flight.

The engine thread appends tokens to a request as they are sampled; the stream reads them every
`POLL_S` or longer when many requests stream (`Pacing`), and at once when a request finishes, so a
chunk may carry several new tokens. A running request's newest token waits for the next one (or the
end): the checks that may finish the request on it (stop strings, grammar) run after it is appended.
Per-request `stream_interval` (SGLang's sampling parameter) holds a chunk until that many tokens are
new. Not held back: text that a `stop_regex` match will trim (no finite tail bounds a pattern's
match), so with `stop_regex` only the last chunk's text is sure to be the reply's.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from miles.engine.request import Request

log = logging.getLogger(__name__)

POLL_S = 0.01
"""Shortest wait between two looks at a running request."""
MAX_POLL_S = 0.5
HOST_SHARE = 0.2
"""Share of the event loop's time that all streams together aim to spend building chunks."""
DONE = b"data: [DONE]\n\n"
RECORDED_FIELDS = ("output", "logprobs", "versions")
"""Request lists the engine thread appends to for every output token, in this order; a snapshot cuts
them to its length (the per-token lists of `req.opts` are cut to `len(output)` by replies.py)."""
PER_TOKEN_META = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
    "miles_output_token_weight_versions",
)
"""meta_info lists with one entry per output token (sliced in incremental mode, as SGLang's)."""

Reply = Callable[[Request, bool], dict[str, Any]]


def add_args(p: argparse.ArgumentParser) -> None:
    """The engine's streaming flag (SGLang's server argument of the same name)."""
    p.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="streamed /generate chunks carry only new text, ids and log-probs (default: cumulative)",
    )


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def error_payload(message: str, code: int = 400) -> dict[str, Any]:
    """SGLang's in-stream error object."""
    kind = "invalid_request_error" if code < 500 else "internal_server_error"
    return {"error": {"message": message, "type": kind, "code": code, "retryable": False}}


def _num_recorded(req: Request) -> int:
    """Output tokens whose per-token entries are all recorded (the engine thread appends them in turn)."""
    return min(len(getattr(req, name)) for name in RECORDED_FIELDS)


def _snapshot(req: Request, n: int) -> Request:
    """A shallow copy of a request in flight, cut to its first `n` output tokens, not finished (the
    engine thread may finish the request meanwhile: what only a finished one carries is left out)."""
    snap = copy.copy(req)
    for name in RECORDED_FIELDS:
        setattr(snap, name, getattr(req, name)[:n])
    snap.finish = None
    snap.routed_experts = None
    return snap


def _settled_text(text: str, req: Request) -> str:
    """The part of a running request's text that the final reply will keep: without a trailing
    partial character (decoded as U+FFFD until its last byte arrives) and, when the request has stop
    strings, cut where one already appears, or else without a tail that could still become one."""
    text = text.rstrip("\ufffd")
    stop = getattr(req.params, "stop", None)
    stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if s]
    if not stops:
        return text
    keep = bool(getattr(req.params, "no_stop_trim", False))
    hits = sorted((text.find(s), s) for s in stops if s in text)
    if hits:
        pos, s = hits[0]
        return text[: pos + len(s)] if keep else text[:pos]
    hold = 0 if keep else max(len(s) for s in stops) - 1
    return text[: max(len(text) - hold, 0)]


@dataclass
class Pacing:
    """Streams share the event loop (and the GIL) with the engine thread's host work; a cumulative
    chunk costs O(tokens so far) to build. The wait between looks grows with the requests streamed
    and the measured cost of a chunk, so building chunks stays near `HOST_SHARE` of one core."""

    requests: int = 0
    chunk_s: float = 0.0
    """Moving average of the host time one chunk takes (build + encode)."""

    def poll_s(self) -> float:
        return min(max(POLL_S, self.requests * self.chunk_s / HOST_SHARE), MAX_POLL_S)

    def record(self, seconds: float) -> None:
        self.chunk_s += 0.1 * (seconds - self.chunk_s)


PACING = Pacing()
"""The process's one pacing (one engine, one event loop)."""


@dataclass
class _Progress:
    """What one request's stream has sent so far."""

    tokens: int = 0
    text: str = ""


def _chunk(
    out: dict[str, Any], req: Request, sent: _Progress, n: int, final: bool, incremental: bool
) -> dict[str, Any]:
    """Turn a reply for the first `n` tokens into this stream's next chunk and record it as sent."""
    text = out.get("text")
    if isinstance(text, str) and not final:
        text = out["text"] = _settled_text(text, req)
    if incremental:
        if isinstance(text, str):  # sent text is never taken back: a delta only extends it
            out["text"] = text[len(sent.text) :] if text.startswith(sent.text) else ""
        out["output_ids"] = out["output_ids"][sent.tokens :]
        meta = out["meta_info"]
        for key in PER_TOKEN_META:
            if isinstance(meta.get(key), list):
                meta[key] = meta[key][sent.tokens :]
    sent.tokens, sent.text = n, text if isinstance(text, str) else ""
    return out


async def events(
    reqs: list[tuple[Request, bool]],
    reply: Reply,
    abort: Callable[[str], None],
    to_json: Callable[[Any], bytes],
    *,
    indexed: bool,
    incremental: bool,
) -> AsyncIterator[bytes]:
    """The SSE body for submitted requests `reqs` ((request, return_logprob) pairs); `reply(req,
    return_logprob)` is the non-streamed reply of a request, `abort(rid)` stops one in flight."""
    waiters = {i: asyncio.wrap_future(r.done) for i, (r, _) in enumerate(reqs)}
    sent = [_Progress() for _ in reqs]
    PACING.requests += len(reqs)
    try:
        while waiters:
            timeout = PACING.poll_s()
            await asyncio.wait(waiters.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for i in list(waiters):
                start = time.perf_counter()
                finished = waiters[i].done()
                data = _next_chunk(reqs[i], finished, sent[i], reply, incremental)
                if data is None:
                    continue
                if finished:
                    del waiters[i]
                    PACING.requests -= 1
                if indexed:
                    data["index"] = i
                chunk = event(to_json(data))
                PACING.record(time.perf_counter() - start)
                yield chunk
        yield DONE
    except Exception as e:  # an engine bug must not leave the client waiting: say it in the stream
        log.error("streamed /generate failed", exc_info=e)
        yield event(to_json(error_payload(f"{type(e).__name__}: {e}", 500)))
        yield DONE
    finally:
        PACING.requests -= len(waiters)
        for i in waiters:  # disconnected, or failed: stop what is still running
            abort(reqs[i][0].rid)


def _next_chunk(
    item: tuple[Request, bool], finished: bool, sent: _Progress, reply: Reply, incremental: bool
) -> dict[str, Any] | None:
    """The request's next chunk, or None while it has too few new tokens (`stream_interval`)."""
    req, return_logprob = item
    if finished:
        return _chunk(reply(req, return_logprob), req, sent, len(req.output), True, incremental)
    n = _num_recorded(req) - 1  # the newest token's finish checks may still be running: wait for the next
    if n - sent.tokens < max(getattr(req.params, "stream_interval", None) or 1, 1):
        return None
    try:
        out = reply(_snapshot(req, n), return_logprob)
    except ValueError:  # a per-token list one entry behind the others (mid-append): next poll
        return None
    return _chunk(out, req, sent, n, False, incremental)
