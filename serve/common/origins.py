"""An httpx transport with one connection pool per origin (scheme, host, port).

httpcore's pool scans every connection it holds on each request and each response close,
so one pool over the connections to a thousand workers costs O(workers) per request: a
frontend idle in front of 256 simulated workers spent a whole core on its load polls, nine
tenths of it in that scan. One pool per worker keeps the scan to that worker's few
connections. `forget(url)` closes the pool of a worker that left.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class PerOriginTransport(httpx.AsyncBaseTransport):
    def __init__(self, **pool_kwargs: Any) -> None:
        self.pool_kwargs = pool_kwargs  # for each origin's httpx.AsyncHTTPTransport (limits, ...)
        self.pools: dict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}
        self._closing: set[asyncio.Task] = set()

    @staticmethod
    def _key(url: httpx.URL) -> tuple[bytes, bytes, int | None]:
        return url.raw_scheme, url.raw_host, url.port

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = self._key(request.url)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = httpx.AsyncHTTPTransport(**self.pool_kwargs)
        return await pool.handle_async_request(request)

    def forget(self, url: str) -> None:
        """Close the connections to `url`'s origin (a worker that left); a later request
        opens a new pool."""
        pool = self.pools.pop(self._key(httpx.URL(url)), None)
        if pool is not None:
            task = asyncio.get_running_loop().create_task(pool.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        pools, self.pools = list(self.pools.values()), {}
        await asyncio.gather(*(p.aclose() for p in pools), *self._closing, return_exceptions=True)
