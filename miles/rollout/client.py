"""Async HTTP client for SGLang's native API: real SGLang servers, the embedded engine, the router.

Only fields of SGLang's protocol are sent, so the same client works against all three. Transport
failures and 502/503/504 answers (an engine restarting, a router with no worker yet) are retried
with backoff for calls that are safe to repeat; weight-update calls are never retried (a repeated
broadcast would desynchronise the update group). Every error names the URL and the server's
message.

Transport: aiohttp, whose per-request cost is about a tenth of httpx's (0.3 vs 3.7 ms of CPU per
/generate at 64 in flight, measured on the 2-core CI machine), which matters where the client shares
a few cores with an engine. Answers are parsed with pydantic_core's Rust parser straight from the
bytes, with the cyclic garbage collector paused meanwhile: the parse makes only acyclic lists and
dicts, and in a process holding torch's many objects the collections its hundreds of thousands of
new containers would trigger cost more than the parse. A batch of 256 x 512-token replies with
log-probs, parsed into GenerateResults: 36 ms, against 190 ms with `json.loads` (2-core CI machine).

Session affinity: a request may carry a routing key (the `X-SMG-Routing-Key` header,
miles.rollout.router.ROUTING_KEY_HEADER); behind sglang-router's `manual` policy every request with
one key goes to one worker, so a multi-turn session finds its prefix in that worker's cache. Pass
`routing_key=` to `generate`, or bind one with `client.with_routing_key(key)`: a view that shares the
client's connections and sends the key on each of its requests. Servers without a router ignore it.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pydantic_core

from miles.rollout.router import ROUTING_KEY_HEADER
from miles.serving import ApiKeys

RETRY_STATUSES = (502, 503, 504)
VERSIONS_KEY = "miles_output_token_weight_versions"


def decode_routed_experts(text: str, rows: int) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 of int32 C-order bytes, shape
    (rows, num_hidden_layers, top_k)) as a compact [rows, num_hidden_layers * top_k] array: uint8
    when every expert id fits, else int16, else int32. The wire carries no layer count or top-k, so
    the trainer, which knows its model, views the rows as [rows, layers, top_k]."""
    flat = np.frombuffer(base64.b64decode(text), dtype="<i4")
    if rows < 1 or flat.size % rows:
        raise ValueError(
            f"routed_experts has {flat.size} int32 values, not a whole number of rows for {rows} rows "
            "(prompt_tokens + completion_tokens - 1)"
        )
    top = int(flat.max(initial=0))
    if int(flat.min(initial=0)) < 0:
        raise ValueError("routed_experts holds a negative expert id")
    dtype = np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32
    return flat.astype(dtype).reshape(rows, -1)


class EngineError(RuntimeError):
    """An engine (or router) call failed; the message names the URL, the route and the reason."""

    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(f"{url}: {message}" + (f" (HTTP {status})" if status else ""))
        self.url = url
        self.status = status


@dataclass
class GenerateResult:
    """One /generate answer, typed."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop`, `length` or `abort`."""
    weight_version: str
    weight_versions: list[str]
    """Weight version per output token (from the embedded engine; else weight_version repeated)."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str = ""
    meta_info: dict[str, Any] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None
    """Expert ids per position [prompt + completion - 1, layers * top_k] (decode_routed_experts),
    when the request asked for `return_routed_experts`; None otherwise."""

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> GenerateResult:
        meta = reply.get("meta_info", {})
        rows = meta.get("output_token_logprobs") or []
        output_ids = list(reply.get("output_ids") or [row[1] for row in rows])
        version = str(meta.get("weight_version", ""))
        finish = meta.get("finish_reason") or {}
        prompt_tokens = int(meta.get("prompt_tokens", 0))
        completion_tokens = int(meta.get("completion_tokens", len(output_ids)))
        routed = meta.get("routed_experts")
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=output_ids,
            # null: a non-finite log-prob (SGLang writes NaN and infinities as null)
            logprobs=[math.nan if lp is None else float(lp) for lp, _, _ in rows],
            finish_reason=finish.get("type", "abort") if isinstance(finish, dict) else str(finish),
            weight_version=version,
            weight_versions=list(meta.get(VERSIONS_KEY) or [version] * len(output_ids)),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=int(meta.get("cached_tokens", 0)),
            text=reply.get("text", ""),
            meta_info={k: v for k, v in meta.items() if k != "routed_experts"},
            routed_experts=(
                decode_routed_experts(routed, prompt_tokens + completion_tokens - 1) if routed else None
            ),
        )


@dataclass
class Reply:
    """A fully read HTTP answer, detached from its connection."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The parsed body; ValueError when it is not JSON."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return pydantic_core.from_json(self.content)
        finally:
            if enabled:
                gc.enable()

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


@dataclass
class _Connections:
    """The aiohttp session shared by a client and its routing-key views. A session is bound to the
    event loop that created it; a call from another loop gets a new session."""

    timeout: aiohttp.ClientTimeout
    max_connections: int
    http: aiohttp.ClientSession | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self.http is None or self.loop is not loop or self.http.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            self.http = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
            self.loop = loop
        return self.http

    async def close(self) -> None:
        if self.http is not None and self.loop is asyncio.get_running_loop():
            await self.http.close()
        self.http = None


class SGLangClient:
    """One engine (or router) URL. Safe to share between tasks of one event loop."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 1024,
        keys: ApiKeys | None = None,
    ):
        self.url = url.rstrip("/")
        self.keys = keys or ApiKeys()
        """The engine's (or router's) keys: each request carries the one its route needs."""
        # no bound on the whole call: a non-streamed /generate answers only when done, within timeout_s
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.routing_key: str | None = None
        """Sent as ROUTING_KEY_HEADER on every request of this client (None: no header)."""
        self.lora_path: str | None = None
        """The LoRA adapter every /generate of this client runs with, unless its body names one
        (train.lora: the policy's adapter; None: the base model)."""
        self._conns = _Connections(self.timeout, max_connections)
        self._is_view = False

    def with_routing_key(self, key: str) -> SGLangClient:
        """A view of this client whose every request carries routing key `key` (one session's
        requests then stay on one worker behind sglang-router's `manual` policy). The view shares
        this client's connections; closing it is a no-op (close the client it came from)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"routing key must be a non-empty string, got {key!r}")
        view = copy.copy(self)
        view.routing_key, view._is_view = key, True
        return view

    def _client(self) -> aiohttp.ClientSession:
        return self._conns.session()

    async def aclose(self) -> None:
        """Close the connections (a routing-key view leaves them to the client it came from)."""
        if not self._is_view:
            await self._conns.close()

    def _headers(self, route: str, routing_key: str | None) -> dict[str, str] | None:
        key = routing_key if routing_key is not None else self.routing_key
        headers = {ROUTING_KEY_HEADER: key} if key else {}
        headers.update(self.keys.headers(route.split("?", 1)[0]))
        return headers or None

    async def request(
        self, method: str, route: str, body: Any = None, *, retry: bool = True, routing_key: str | None = None
    ) -> Reply:
        """Send one call; raise EngineError on failure (after retries where allowed). `routing_key`
        (else the client's own, if bound) goes in the ROUTING_KEY_HEADER header."""
        attempts = 1 + (self.retries if retry else 0)
        headers = self._headers(route, routing_key)
        if (
            self.lora_path is not None
            and route == "/generate"
            and isinstance(body, dict)
            and "lora_path" not in body
        ):
            body = {**body, "lora_path": self.lora_path}
        last = ""
        for attempt in range(attempts):
            try:
                async with self._client().request(
                    method, self.url + route, json=body, headers=headers
                ) as answer:
                    resp = Reply(answer.status, await answer.read())
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{route}: {type(e).__name__}: {e}"
                status = None
            else:
                if resp.status_code < 400:
                    return resp
                status = resp.status_code
                last = f"{route}: {_message(resp)}"
                if status not in RETRY_STATUSES:
                    raise EngineError(self.url, last, status)
            if attempt + 1 < attempts:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineError(self.url, f"{last} (after {attempts} attempt(s))", status)

    async def _post(
        self, route: str, body: Any = None, *, retry: bool = True, routing_key: str | None = None
    ) -> Any:
        resp = await self.request("POST", route, body, retry=retry, routing_key=routing_key)
        return _json(resp)

    async def _get(self, route: str) -> Any:
        return _json(await self.request("GET", route))

    # ---- generation ----
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
        return_routed_experts: bool = False,
        lora_path: str | None = None,
    ) -> GenerateResult:
        """One /generate; `routing_key` (else the client's bound one) keeps a session on one worker
        behind sglang-router's `manual` policy; `return_routed_experts` asks an MoE engine for its
        expert choice per position (GenerateResult.routed_experts); `lora_path` names the adapter
        (else the client's own, if set)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        return GenerateResult.from_reply(await self._post("/generate", body, routing_key=routing_key))

    async def score(
        self, input_ids: list[int], start: int, routing_key: str | None = None, lora_path: str | None = None
    ) -> tuple[list[float], str]:
        """(log-probs of input_ids[start:] under the served weights, their weight version): one
        /generate of max_new_tokens 0 with SGLang's `logprob_start_len` (a prefill, nothing sampled).
        The rows start one position early: the first row of `input_token_logprobs` carries no log-prob."""
        if not 0 < start <= len(input_ids):
            raise ValueError(f"score: start={start} must be in 1..{len(input_ids)}")
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
        }
        if lora_path is not None:
            body["lora_path"] = lora_path
        meta = (await self._post("/generate", body, routing_key=routing_key)).get("meta_info", {})
        rows = meta.get("input_token_logprobs") or []
        if len(rows) != len(input_ids) - start + 1:
            raise EngineError(
                self.url, f"score: {len(rows)} log-prob rows for {len(input_ids) - start + 1} positions"
            )
        return [float(r[0]) for r in rows[1:]], str(meta.get("weight_version", ""))

    async def tokenize(self, prompt: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `prompt` by the server's own tokenizer (SGLang's /tokenize)."""
        body = {"prompt": prompt, "add_special_tokens": add_special_tokens}
        return list((await self._post("/tokenize", body))["tokens"])

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._post("/abort_request", {"rid": rid or "", "abort_all": abort_all})

    # ---- health and info ----
    async def health(self) -> bool:
        try:
            async with self._client().get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=5.0)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise EngineError(self.url, f"/health not OK after {timeout_s} s")
            await asyncio.sleep(poll_s)

    async def _get_info(self, name: str) -> dict[str, Any]:
        """GET /<name> (SGLang's current route); servers that predate it answer 404 and are asked at
        its older name /get_<name>, which the embedded engine also keeps."""
        try:
            return await self._get(f"/{name}")
        except EngineError as e:
            if e.status != 404:
                raise
            return await self._get(f"/get_{name}")

    async def get_model_info(self) -> dict[str, Any]:
        return await self._get_info("model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self._get_info("server_info")

    async def get_weight_version(self) -> str:
        """The served weight version, from /model_info (SGLang's place for it; servers that predate
        that route answer 404 and are asked at /get_model_info)."""
        try:
            info = await self._get("/model_info")
        except EngineError as e:
            if e.status != 404:
                raise
            info = await self._get("/get_model_info")
        return str(info["weight_version"])

    # ---- control ----
    async def pause_generation(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache")

    # ---- weights ----
    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        return _checked(self.url, await self._post("/update_weights_from_disk", body, retry=False))

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return _checked(self.url, await self._post("/init_weights_update_group", body, retry=False))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        body = {"group_name": group_name}
        return _checked(self.url, await self._post("/destroy_weights_update_group", body, retry=False))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
        return _checked(self.url, await self._post("/update_weights_from_distributed", body, retry=False))

    async def begin_weight_update(self, selector: str = "all") -> dict[str, Any]:
        """Open SGLang's weight-update session (SGLang >= 0.5.23 loads tensor and distributed
        updates only inside one; the embedded engine takes them either way)."""
        return _checked(
            self.url, await self._post("/begin_weight_update", {"selector": selector}, retry=False)
        )

    async def end_weight_update(self) -> dict[str, Any]:
        return _checked(self.url, await self._post("/end_weight_update", {}, retry=False))

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Set the served weight version. SGLang's own default aborts every request; this client
        sends False unless told, as upstream trainers do."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return _checked(self.url, await self._post("/update_weight_version", body, retry=False))

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        body = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
        return _checked(self.url, await self._post("/update_weights_from_tensor", body, retry=False))

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the engine's accelerator memory (colocated training); `tags` as SGLang's (None: all)."""
        return _checked(self.url, await self._post("/release_memory_occupation", {"tags": tags}))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return _checked(self.url, await self._post("/resume_memory_occupation", {"tags": tags}))

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return await self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})


def _message(resp: Reply) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        return str(data.get("message") or data.get("detail") or data)[:500]
    return str(data)[:500]


def _json(resp: Reply) -> Any:
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text


def _checked(url: str, reply: Any) -> dict[str, Any]:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineError(url, str(reply.get("message")))
    return reply
