"""An httpx transport with one connection pool per origin (scheme, host, port).

httpcore's pool scans every connection it holds on each request and each response close,
so one pool over the connections to a thousand workers costs O(workers) per request: a
frontend idle in front of 256 simulated workers spent a whole core on its load polls, nine
tenths of it in that scan. One pool per worker keeps the scan to that worker's few
connections. `forget(url)` retires the pool of a worker that left: no new request uses it,
and it closes once its last response (a stream a draining worker is finishing) is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx

Key = tuple[bytes, bytes, int | None]


class _Origin:
    def __init__(self, pool: httpx.AsyncHTTPTransport) -> None:
        self.pool = pool
        self.active = 0  # responses not closed yet
        self.retired = False


class _Tracked(httpx.AsyncByteStream):
    """A response body that tells its origin when it is closed. Iterating it is iterating the
    wrapped body itself (no generator in between: a chunk a token on the streams' hot path)."""

    def __init__(self, stream: httpx.AsyncByteStream, closed: Any) -> None:
        self.stream = stream
        self.closed = closed

    def __aiter__(self) -> AsyncIterator[bytes]:  # type: ignore[override]
        return self.stream.__aiter__()

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            closed, self.closed = self.closed, None
            if closed is not None:
                closed()


class PerOriginTransport(httpx.AsyncBaseTransport):
    def __init__(self, **pool_kwargs: Any) -> None:
        self.pool_kwargs = pool_kwargs  # for each origin's httpx.AsyncHTTPTransport (limits, ...)
        self.origins: dict[Key, _Origin] = {}
        self._closing: set[asyncio.Task] = set()

    @property
    def pools(self) -> dict[Key, httpx.AsyncHTTPTransport]:
        return {k: o.pool for k, o in self.origins.items()}

    @staticmethod
    def _key(url: httpx.URL) -> Key:
        return url.raw_scheme, url.raw_host, url.port

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = self._key(request.url)
        origin = self.origins.get(key)
        if origin is None:
            origin = self.origins[key] = _Origin(httpx.AsyncHTTPTransport(**self.pool_kwargs))
        origin.active += 1
        try:
            resp = await origin.pool.handle_async_request(request)
        except BaseException:
            self._done(origin)
            raise
        resp.stream = _Tracked(resp.stream, lambda: self._done(origin))  # type: ignore[arg-type]
        return resp

    def _done(self, origin: _Origin) -> None:
        origin.active -= 1
        if origin.retired and origin.active == 0:
            self._close(origin)

    def forget(self, url: str) -> None:
        """A worker left: new requests to its origin get a new pool; the old one closes when
        its last response is closed (at once when it has none)."""
        origin = self.origins.pop(self._key(httpx.URL(url)), None)
        if origin is not None:
            origin.retired = True
            if origin.active == 0:
                self._close(origin)

    def _close(self, origin: _Origin) -> None:
        task = asyncio.get_running_loop().create_task(origin.pool.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        origins, self.origins = list(self.origins.values()), {}
        await asyncio.gather(*(o.pool.aclose() for o in origins), *self._closing, return_exceptions=True)
