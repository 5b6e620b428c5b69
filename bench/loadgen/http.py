"""A lean HTTP/1.1 client for load generation: keep-alive connections, raw asyncio protocol.

While a request is in flight the client does as little as it can: it writes pre-encoded
bytes, and for each arriving piece of the response takes a monotonic timestamp
(`time.perf_counter_ns`, at byte arrival) and keeps the bytes, scanning only the chunked
framing to know where the response ends. Decoding chunks, splitting SSE events and parsing
JSON wait until the run is over (records.py), so they never delay a timestamp.

One `Pool` per client process; connections are reused across requests (no per-request
session), opened on demand, dropped when the server says `connection: close` or fails, and
never reused after `IDLE_EXPIRY_S` idle: a server closes idle keep-alive connections on its
own timer (uvicorn, so vLLM's server, after 5 s), and a request written as that close is on
its way meets a reset.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

_now = time.perf_counter_ns
# Below the common servers' keep-alive timeouts (uvicorn's 5 s), as httpx's own expiry is.
IDLE_EXPIRY_S = 4.0


class HTTPError(Exception):
    """Transport-level failure of one request (connection refused, reset, bad framing)."""


@dataclass
class RawResponse:
    """What arrived for one request: status, headers, and (timestamp, bytes) pieces of the
    body as they came off the socket (still chunk-encoded when `chunked`)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False
    pieces: list[tuple[int, bytes]] = field(default_factory=list)
    head_ns: int = 0  # when the status line and headers were complete
    end_ns: int = 0


class _Conn(asyncio.Protocol):
    __slots__ = ("transport", "pool", "resp", "done", "buf", "state", "left", "keep", "closed", "idle_since")

    def __init__(self, pool: "Pool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.resp: RawResponse | None = None
        self.done: asyncio.Future | None = None
        self.buf = b""
        self.state = 0  # 0 head, 1 chunked body, 2 length body, 3 until close
        self.left = 0  # bytes of body (length) or of current chunk incl. CRLF (chunked)
        self.keep = True
        self.closed = False
        self.idle_since = 0.0  # time.monotonic() when it went back to the pool

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        fut, self.done = self.done, None
        if fut is not None and not fut.done():
            if self.state == 3 and self.resp is not None:
                self.resp.end_ns = _now()
                fut.set_result(self.resp)
            else:
                fut.set_exception(HTTPError(f"connection closed mid-response{': ' + str(exc) if exc else ''}"))

    def send(self, data: bytes, fut: asyncio.Future) -> RawResponse:
        self.resp = RawResponse()
        self.done = fut
        self.buf = b""
        self.state = 0
        if self.transport is None:
            raise HTTPError("connection closed before the request was sent")
        self.transport.write(data)
        return self.resp

    def _finish(self) -> None:
        resp, fut = self.resp, self.done
        self.done = None
        if resp is not None:
            resp.end_ns = _now()
        if fut is not None and not fut.done():
            fut.set_result(resp)

    def data_received(self, data: bytes) -> None:
        now = _now()
        resp = self.resp
        if resp is None or self.done is None:
            return  # stray bytes after a finished/abandoned response; the pool drops us
        if self.state == 0:
            # The previous response's last CRLF may arrive late, ahead of this head: skip it.
            self.buf = (self.buf + data).lstrip(b"\r\n") if not self.buf else self.buf + data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            try:
                self._head(self.buf[:end].decode("latin-1"))
            except (ValueError, IndexError) as e:
                fut, self.done = self.done, None
                self.keep = False
                fut.set_exception(HTTPError(f"malformed response head: {e}"))
                return
            resp.head_ns = now
            data = self.buf[end + 4:]
            self.buf = b""
            if self.state == 2 and self.left == 0:
                return self._finish()
            if not data:
                return
        resp.pieces.append((now, data))
        if self.state == 1:
            self._scan_chunks(data)
        elif self.state == 2:
            self.left -= len(data)
            if self.left <= 0:
                self._finish()

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        resp = self.resp
        assert resp is not None
        resp.status = int(lines[0].split(" ", 2)[1])
        for line in lines[1:]:
            k, _, v = line.partition(":")
            resp.headers[k.strip().lower()] = v.strip()
        h = resp.headers
        self.keep = h.get("connection", "").lower() != "close" and lines[0].startswith("HTTP/1.1")
        if "chunked" in h.get("transfer-encoding", "").lower():
            resp.chunked = True
            self.state = 1
            self.left = 0
        elif "content-length" in h:
            self.state = 2
            self.left = int(h["content-length"])
        else:
            self.state = 3
            self.keep = False

    def _scan_chunks(self, data: bytes) -> None:
        """Advance over chunk framing only; payload bytes are skipped by count."""
        pos, n = 0, len(data)
        if self.buf:  # a partial size line from the previous piece
            data = self.buf + data
            pos, n = 0, len(data)
            self.buf = b""
        while pos < n:
            if self.left > 0:
                step = min(self.left, n - pos)
                self.left -= step
                pos += step
                continue
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                self.buf = data[pos:]
                return
            size = int(data[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                # Last chunk; trailers (rare) end at an empty line, which we do not wait for
                # unless they are present in this piece.
                self._finish()
                return
            self.left = size + 2
            pos = eol + 2


class Pool:
    """Keep-alive connections to one host:port. `request()` sends one request and returns
    its RawResponse; the caller owns timeouts (cancel the task, the connection is dropped)."""

    def __init__(self, host: str, port: int, idle_expiry_s: float = IDLE_EXPIRY_S) -> None:
        self.host = host
        self.port = port
        self.idle_expiry_s = idle_expiry_s
        self.idle: deque[_Conn] = deque()
        self.opened = 0
        self.expired = 0  # idle connections closed unused (past idle_expiry_s)

    async def _get(self) -> _Conn:
        # `idle` is in the order connections came back: the expired ones are its oldest, closed
        # here (not left holding a socket until the server drops them); the newest is reused.
        horizon = time.monotonic() - self.idle_expiry_s
        while self.idle and (self.idle[0].closed or self.idle[0].idle_since <= horizon):
            c = self.idle.popleft()
            if not c.closed:
                self.expired += 1
                if c.transport is not None:
                    c.transport.close()
        while self.idle:
            c = self.idle.pop()
            if not c.closed:
                return c
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except OSError as e:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from e
        self.opened += 1
        return conn

    async def request(self, data: bytes) -> RawResponse:
        """Send `data` (a full HTTP request); return the complete response."""
        conn = await self._get()
        fut = asyncio.get_running_loop().create_future()
        try:
            conn.send(data, fut)
            resp = await fut
        except BaseException:
            conn.keep = False
            if conn.transport is not None:
                conn.transport.abort()
            raise
        if conn.keep and not conn.closed:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()
        return resp

    def close(self) -> None:
        for c in self.idle:
            if c.transport is not None:
                c.transport.close()
        self.idle.clear()


def request_head(method: str, host: str, port: int, path: str, headers: dict[str, str], length: int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             "Accept: text/event-stream, application/json", f"Content-Length: {length}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def decode_chunked(pieces: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """De-chunk a chunked body, keeping each payload byte's arrival timestamp:
    returns (timestamp, payload) per arrived piece (empty payloads dropped)."""
    out: list[tuple[int, bytes]] = []
    buf = b""
    left = 0  # payload bytes left in the current chunk
    crlf = 0  # CRLF bytes after the current chunk still to skip
    done = False
    for ts, data in pieces:
        if done:
            break
        payload = []
        data = buf + data
        buf = b""
        pos, n = 0, len(data)
        while pos < n:
            if left:
                step = min(left, n - pos)
                payload.append(data[pos:pos + step])
                left -= step
                pos += step
                if not left:
                    crlf = 2
                continue
            if crlf:
                step = min(crlf, n - pos)
                crlf -= step
                pos += step
                continue
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                buf = data[pos:]
                break
            size = int(data[pos:eol].split(b";", 1)[0], 16)
            pos = eol + 2
            if size == 0:
                done = True
                break
            left = size
        if payload:
            out.append((ts, b"".join(payload)))
    return out
