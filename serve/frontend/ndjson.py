"""Reading a worker's NDJSON token stream (`serve.protocol.TokenDelta` lines) off an httpx
response: split from the body bytes (no text decoding), bounded by the read timeout and the request's deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import httpx


class NdjsonLines:
    """The lines of a worker's NDJSON stream, from its bytes (no text decoding). A stall
    ends in httpx's read timeout, the request's deadline in `asyncio.timeout` once it is
    nearer than a read timeout (no timeout context per line before that); both raise
    TimeoutError."""

    DRAIN_S = 2.0

    def __init__(self, resp: httpx.Response, read_timeout_s: float) -> None:
        self.raw = resp.aiter_bytes()
        self.read_timeout_s = read_timeout_s
        self.pending: deque[bytes] = deque()
        self.partial = b""

    async def next(self, deadline: float) -> bytes:
        while not self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            try:
                if remaining < self.read_timeout_s:
                    async with asyncio.timeout(remaining):
                        chunk = await anext(self.raw)
                else:
                    chunk = await anext(self.raw)
            except httpx.ReadTimeout:
                raise asyncio.TimeoutError() from None
            except StopAsyncIteration:
                if self.partial.strip():  # a last line without its newline
                    self.pending.append(self.partial)
                    self.partial = b""
                    break
                raise
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            self.pending.extend(line for line in lines if line.strip())
        return self.pending.popleft()

    async def drain(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.DRAIN_S):
                async for _ in self.raw:
                    pass
