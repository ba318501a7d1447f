"""What every HTTP server of Miles shares: a request whose client hangs up stops its work.

SGLang aborts a request whose HTTP client has disconnected, waiting or running, streamed or not, and
logs it. Starlette does not cancel a handler when its client leaves (a plain response is computed to
the end and then written to nobody), so `CancelOnDisconnect` wraps an ASGI app: it reads the
connection's messages itself, hands them to the app through a queue, and when the server reports
`http.disconnect` before the response is complete it cancels the handler. The handler's own cleanup
runs on that cancellation: the engine's routes abort their scheduler requests (miles/engine/server.py,
miles/engine/openai_routes.py), and the session server's call to the engine is closed, which the
engine in turn sees as a client that left.

And the keys every server takes (docs/security.md): `ApiKeys` decides a request as SGLang does
(`--api-key` for every route but the health probes, `--admin-api-key` for the routes that change what
is served), `RequireApiKey` answers 401 before the app runs, and `check_bind` refuses to serve beyond
loopback without a key unless told so. Keys are read from files of mode 600, never from the command
line, where every user of the node could read them in `ps`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import secrets
import urllib.parse
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Scope = dict[str, Any]


class CancelOnDisconnect:
    """ASGI middleware: cancel an HTTP request's handler when its client disconnects first."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inbox: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            while True:
                message = await receive()
                inbox.put_nowait(message)
                if message["type"] == "http.disconnect":
                    return

        handler = asyncio.ensure_future(self.app(scope, inbox.get, send))
        reader = asyncio.ensure_future(read())
        try:
            await asyncio.wait({handler, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not handler.done():  # the client left before the response was complete
                handler.cancel()
                log.info(
                    "%s %s: the client disconnected; its request was cancelled",
                    scope["method"],
                    scope["path"],
                )
                with contextlib.suppress(asyncio.CancelledError):
                    await handler
                return
            await handler
        finally:
            reader.cancel()
            if not handler.done():
                handler.cancel()


# ---- API keys, as SGLang's servers take them ----

ADMIN_ROUTES = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/load_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/weights_checker",
        "/debug/inject_fault",
    }
)
"""Routes that change what a server serves (weights, adapters, memory, pause/abort): with an admin
key set they take only the admin key."""

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Probes answered without a key (SGLang's rule), so a router or a scheduler can watch the server."""


@dataclasses.dataclass(frozen=True)
class ApiKeys:
    """A server's keys (or a client's copy of them). None: that key is not set.

    SGLang's semantics (srt/utils/auth.py): with `api` set, every route but the probes needs
    `Authorization: Bearer <api>`; an admin route needs the admin key when `admin` is set, else the
    api key when that is set, else nothing."""

    api: str | None = None
    admin: str | None = None

    def __bool__(self) -> bool:
        return bool(self.api or self.admin)

    def allows(self, path: str, authorization: str | None, x_api_key: str | None = None) -> bool:
        path = "/" + "/".join(part for part in path.split("/") if part)  # `//x/` is judged as `/x`
        if path.startswith(OPEN_PREFIXES):
            return True
        needed = (self.admin or self.api) if path in ADMIN_ROUTES else self.api
        if not needed:
            return True
        offered = x_api_key or ""
        if authorization and authorization[:7].lower() == "bearer ":
            offered = authorization[7:]
        return secrets.compare_digest(offered.encode(), needed.encode())

    def headers(self, path: str) -> dict[str, str]:
        """The Authorization header a client of these keys sends to `path` (none without keys)."""
        key = (self.admin or self.api) if path in ADMIN_ROUTES else self.api
        return {"Authorization": f"Bearer {key}"} if key else {}

    @classmethod
    def from_files(cls, api_file: str | Path | None, admin_file: str | Path | None) -> ApiKeys:
        return cls(read_key_file(api_file), read_key_file(admin_file))


def read_key_file(path: str | Path | None) -> str | None:
    """The key in `path` (its first line, stripped); None for no path. A file other users can read
    is refused: a key in it is no secret."""
    if path is None:
        return None
    p = Path(path)
    try:
        mode = p.stat().st_mode
        key = p.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the key file {p}: {e.strerror}") from None
    if mode & 0o077:
        raise ValueError(f"key file {p} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
    if not key:
        raise ValueError(f"key file {p} is empty")
    return key


def write_key_file(path: Path) -> str:
    """A new random key in `path` (mode 600, created so no other user ever sees it); the key."""
    key = secrets.token_urlsafe(32)
    while key.startswith("-"):  # a command line would read such a key as a flag
        key = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)
    return key


KEYS_DIR = "keys"
API_KEY_FILE = "api_key"
ADMIN_KEY_FILE = "admin_api_key"


def key_files(run_dir: str | Path) -> tuple[Path, Path]:
    """Where a run keeps its servers' keys: RUN_DIR/keys/{api_key,admin_api_key} (mode 600)."""
    folder = Path(run_dir) / KEYS_DIR
    return folder / API_KEY_FILE, folder / ADMIN_KEY_FILE


def make_run_keys(run_dir: str | Path) -> ApiKeys:
    """New keys for a run's servers, written under RUN_DIR/keys/ (mode 600, the folder 700) and
    handed to the run's own processes only: engines, router and clients read them from there.
    A run directory that has keys keeps them (a resumed run's engines and clients agree)."""
    api, admin = key_files(run_dir)
    api.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(api.parent, 0o700)
    if not api.exists():
        write_key_file(api)
    if not admin.exists():
        write_key_file(admin)
    return run_keys(run_dir)


def run_keys(run_dir: str | Path) -> ApiKeys:
    """The run's keys (ApiKeys() when it has none)."""
    api, admin = key_files(run_dir)
    return ApiKeys(
        read_key_file(api) if api.exists() else None, read_key_file(admin) if admin.exists() else None
    )


def key_arguments(run_dir: str | Path) -> list[str]:
    """The key flags that start a Miles server of this run with the run's keys (none without keys)."""
    api, admin = key_files(run_dir)
    return [
        *(["--api-key-file", str(api)] if api.exists() else []),
        *(["--admin-api-key-file", str(admin)] if admin.exists() else []),
    ]


def sglang_key_arguments(run_dir: str | Path) -> list[str]:
    """The same keys as SGLang's flags, which take them on the command line only (so a user of the
    node may read them in `ps`: docs/security.md)."""
    keys = run_keys(run_dir)
    return [
        *([f"--api-key={keys.api}"] if keys.api else []),  # `=`: a key may start with "-"
        *([f"--admin-api-key={keys.admin}"] if keys.admin else []),
    ]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_bind(server: str, host: str, keys: ApiKeys, allow_unauthenticated: bool) -> None:
    """Refuse to serve beyond loopback with no key, unless told so explicitly (ValueError saying how)."""
    if keys.api or is_loopback(host) or allow_unauthenticated:
        return
    raise ValueError(
        f"{server}: --host {host} serves beyond this machine and no --api-key-file is set, so anyone who "
        "can reach it could use it (weight and adapter routes included); give --api-key-file (and "
        "--admin-api-key-file), bind 127.0.0.1, or pass --allow-unauthenticated to serve it open anyway"
    )


def add_key_arguments(p: Any) -> None:
    """The key flags every Miles server takes (argparse)."""
    p.add_argument("--api-key-file", default=None, help="file with the API key every route but /health needs")
    p.add_argument(
        "--admin-api-key-file",
        default=None,
        help="file with the admin key that weight, adapter, memory and pause/abort routes need",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback --host without an API key (anyone who can reach it can use it)",
    )


KEY_COOKIE = "miles_api_key"


class RequireApiKey:
    """ASGI middleware: a request the keys do not allow is answered 401 before the app sees it.

    With `browser` (the dashboard), a page opened once as `/?key=KEY` sets an HttpOnly cookie holding
    the key and is sent on without the query, so a browser's later requests carry the key too."""

    def __init__(self, app: Any, keys: ApiKeys, *, browser: bool = False) -> None:
        self.app, self.keys, self.browser = app, keys, browser

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and self.keys:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            offered = headers.get("x-api-key")
            if self.browser:
                if await self._login(scope, send):
                    return
                offered = offered or _cookie(headers.get("cookie", ""), KEY_COOKIE)
            if not self.keys.allows(scope["path"], headers.get("authorization"), offered):
                body = json.dumps({"error": "Unauthorized", "message": "a valid API key is required"})
                await _answer(
                    send,
                    401,
                    [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                    body,
                )
                return
        await self.app(scope, receive, send)

    async def _login(self, scope: Scope, send: Any) -> bool:
        """`?key=KEY` with the right key: set the cookie and redirect to the same path (True)."""
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        key = (query.get("key") or [None])[0]
        if (
            key is None
            or not self.keys.api
            or not secrets.compare_digest(key.encode(), self.keys.api.encode())
        ):
            return False
        cookie = f"{KEY_COOKIE}={key}; HttpOnly; SameSite=Strict; Path=/"
        await _answer(
            send, 303, [(b"location", scope["path"].encode()), (b"set-cookie", cookie.encode())], ""
        )
        return True


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None


async def _answer(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


# ---- request bodies of bounded size ----

DRAIN_FACTOR = 4
"""A body up to this many times the limit is read to its end (and dropped) so that the client sees
the 413; a larger one is cut off."""


class BodyTooLarge(ValueError):
    """A request body over the server's limit (answer 413 with this message)."""


async def read_limited(request: Any, limit: int, knob: str) -> bytes:
    """The raw body of a starlette `request`, at most `limit` bytes. A declared Content-Length is checked
    before reading, a chunked body is counted while read; BodyTooLarge (naming `knob`, the setting that
    raises the limit) beyond it, ValueError for a Content-Length that is not a number."""
    header = request.headers.get("content-length")
    declared = None
    if header is not None:
        try:
            declared = int(header)
        except ValueError:
            raise ValueError(f"Content-Length {header!r} is not an integer") from None
        if declared > DRAIN_FACTOR * limit:
            raise _too_large(declared, limit, True, knob)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit or (declared or 0) > limit:
            chunks = []  # dropped: read on only so that the client sees the answer
            if size > DRAIN_FACTOR * limit:
                break
        else:
            chunks.append(chunk)
    if size > limit or (declared or 0) > limit:
        raise _too_large(declared if declared is not None else limit, limit, declared is not None, knob)
    return b"".join(chunks)


def _too_large(size: int, limit: int, declared: bool, knob: str) -> BodyTooLarge:
    what = "declares" if declared else "has more than"
    return BodyTooLarge(
        f"request body {what} {size} bytes; this server takes at most {limit} (raise it with {knob})"
    )
