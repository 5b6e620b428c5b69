"""HTTP helpers shared by the frontend and the workers.

Starlette stops listening for client disconnects under ASGI spec 2.4 (uvicorn's), so a
stream that is waiting for its first token would not notice a client that went away.
These helpers always watch `receive()` for `http.disconnect` and cancel the work, which
is what turns a closed connection into an engine abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectAwareStreamingResponse(Response):
    """A streaming response that cancels its body iterator when the client disconnects."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status_code: int = 200,
        media_type: str | None = None,
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.body_iterator = content
        self.on_close = on_close  # runs however the response ends, even if never started
        self.status_code = status_code
        self.media_type = media_type
        self.init_headers(headers)
        self.background = None

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if stream in done:
                exc = stream.exception()
                if exc is not None and not isinstance(exc, OSError):
                    raise exc
        finally:
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            if self.on_close is not None:
                self.on_close()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


