"""What every HTTP server of Miles shares: a request whose client hangs up stops its work.

SGLang aborts a request whose HTTP client has disconnected, waiting or running, streamed or not, and
logs it. Starlette does not cancel a handler when its client leaves (a plain response is computed to
the end and then written to nobody), so `CancelOnDisconnect` wraps an ASGI app: it reads the
connection's messages itself, hands them to the app through a queue, and when the server reports
`http.disconnect` before the response is complete it cancels the handler. The handler's own cleanup
runs on that cancellation: the engine's routes abort their scheduler requests (miles/engine/server.py,
miles/engine/openai_routes.py), and the session server's call to the engine is closed, which the
engine in turn sees as a client that left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
