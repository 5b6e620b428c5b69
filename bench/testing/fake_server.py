"""A fast OpenAI-compatible fake server with programmed delays.

`pdserve bench fake-server` answers `/v1/chat/completions` and `/v1/completions` (streaming
and not), `/v1/models` and `/health`, and nothing else. It is what the load generator is
tested and benchmarked against: its first token leaves `--ttft-ms` after the request's last
byte arrives, each next token `--itl-ms` after the one before, so a client's measured TTFT and
ITL can be checked against known values. With zero delays a whole stream leaves in one write,
so it costs the server little and the client's cost dominates a benchmark.

The reply has `max_tokens` (or `max_completion_tokens`, else `--osl`) tokens; each token is
one common English word that is a single token under GPT-2/Llama-style tokenizers, so a
client counting tokens with a tokenizer gets the same count as `usage.completion_tokens`.
With `--tokenizer`, `usage.prompt_tokens` is counted like vLLM does (chat template applied,
generation prompt added); without, it is the prompt's whitespace-separated word count.

`--fail-every N` answers every N-th generation request with a 500 error envelope, so clients'
error accounting can be tested exactly. It is a raw asyncio protocol (no framework), HTTP/1.1
with keep-alive; it may not import vLLM, torch or anything of serve/. Errors: FakeServerError.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from bench.testing.errors import FakeServerError

WORDS = (" the", " of", " and", " to", " in", " is", " for", " on", " that", " with")
_MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class FakeServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "fake-model"
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    osl: int = 16
    fail_every: int = 0
    tokenizer: str | None = None


class _Counter:
    def __init__(self, tokenizer: str | None) -> None:
        self.tok = None
        if tokenizer:
            from serve.common.hf_tokenizer import from_pretrained

            self.tok = from_pretrained(tokenizer)

    def chat(self, messages: list[dict]) -> int:
        if self.tok is None:
            return sum(len(str(m.get("content", "")).split()) for m in messages)
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tok.encode(text, add_special_tokens=False))

    def completion(self, prompt: str) -> int:
        if self.tok is None:
            return len(prompt.split())
        return len(self.tok.encode(prompt))


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Replies:
    """Pre-encoded pieces of every reply, so a stream costs joins, not JSON encoding."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.chat_tokens = [self._sse(self._chat_chunk({"content": w}, None)) for w in WORDS]
        self.cmpl_tokens = [self._sse(self._cmpl_chunk(w, None)) for w in WORDS]
        self.chat_role = self._sse(self._chat_chunk({"role": "assistant", "content": ""}, None))
        self.done = _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def _chat_chunk(self, delta: dict, finish: str | None, usage: dict | None = None) -> dict:
        c = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": self.model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage is not None:
            c["choices"] = []
            c["usage"] = usage
        return c

    def _cmpl_chunk(self, text: str, finish: str | None) -> dict:
        return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    @staticmethod
    def _sse(obj: dict) -> bytes:
        return _chunked(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    def token(self, chat: bool, i: int) -> bytes:
        return (self.chat_tokens if chat else self.cmpl_tokens)[i % len(WORDS)]

    def finish(self, chat: bool, usage: dict | None) -> bytes:
        if chat:
            out = self._sse(self._chat_chunk({}, "length"))
            if usage is not None:
                out += self._sse(self._chat_chunk({}, None, usage))
        else:
            out = self._sse(self._cmpl_chunk("", "length"))
            if usage is not None:
                out += self._sse({"id": "cmpl-fake", "object": "text_completion", "created": 0,
                                  "model": self.model, "choices": [], "usage": usage})
        return out + self.done

    def whole(self, chat: bool, n: int, usage: dict) -> dict:
        text = "".join(WORDS[i % len(WORDS)] for i in range(n))
        if chat:
            return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
                    "model": self.model, "usage": usage,
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": text}}]}
        return {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                "model": self.model, "usage": usage,
                "choices": [{"index": 0, "finish_reason": "length", "text": text}]}


class FakeServer:
    """The server's state: config, pre-encoded replies, the request counter."""

    def __init__(self, cfg: FakeServerConfig) -> None:
        self.cfg = cfg
        self.replies = _Replies(cfg.model)
        self.counter = _Counter(cfg.tokenizer)
        self.generations = 0
        self.conns: set[_Conn] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        """Listen on the configured address; the port it got (FakeServerError if it cannot bind)."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _Conn(self), self.cfg.host, self.cfg.port,
                                                    reuse_address=True, backlog=4096)
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)
            raise FakeServerError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {why}") from None
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self.conns):
                if c.transport is not None:
                    c.transport.close()
            await self._server.wait_closed()


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 413: b"Payload Too Large",
              500: b"Internal Server Error"}.get(status, b"Error")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            % (status, reason, content_type, len(body))) + body


def _error(status: int, message: str, kind: str) -> bytes:
    return _response(status, json.dumps({"error": {"message": message, "type": kind, "param": None,
                                                   "code": status}}).encode())


_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")


class _Conn(asyncio.Protocol):
    def __init__(self, server: FakeServer) -> None:
        self.s = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False  # one request at a time per connection (no pipelining)
        self.timers: list[asyncio.TimerHandle] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.s.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        for t in self.timers:
            t.cancel()
        self.timers.clear()
        self.transport = None
        self.s.conns.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > 65536 and self.transport:
                self.transport.write(_error(400, "request head too large", "invalid_request_error"))
                self.transport.close()
            return
        head = self.buf[:end].decode("latin-1")
        lines = head.split("\r\n")
        try:
            method, path, _ = lines[0].split(" ", 2)
        except ValueError:
            if self.transport:
                self.transport.write(_error(400, "malformed request line", "invalid_request_error"))
                self.transport.close()
            return
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip() or 0)
        if length > _MAX_BODY:
            if self.transport:
                self.transport.write(_error(413, "body too large", "invalid_request_error"))
                self.transport.close()
            return
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4:end + 4 + length]
        self.buf = self.buf[end + 4 + length:]
        self.busy = True
        self._handle(method, path.split("?", 1)[0], body)

    def _done(self) -> None:
        self.busy = False
        if self.buf:
            self._next()

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _handle(self, method: str, path: str, body: bytes) -> None:
        cfg = self.s.cfg
        if method == "GET" and path == "/v1/models":
            self._write(_response(200, json.dumps({"object": "list", "data": [
                {"id": cfg.model, "object": "model", "created": 0, "owned_by": "pdserve-fake"}]}).encode()))
            return self._done()
        if method == "GET" and path == "/health":
            self._write(_response(200, b'{"status":"ok"}'))
            return self._done()
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            self._write(_error(404, f"no route {method} {path}", "not_found_error"))
            return self._done()
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise ValueError("body is not a JSON object")
        except ValueError as e:
            self._write(_error(400, f"invalid JSON body: {e}", "invalid_request_error"))
            return self._done()
        self.s.generations += 1
        if cfg.fail_every and self.s.generations % cfg.fail_every == 0:
            self._write(_error(500, "programmed failure", "internal_server_error"))
            return self._done()
        chat = path == "/v1/chat/completions"
        try:
            n = int(req.get("max_completion_tokens") or req.get("max_tokens") or cfg.osl)
            if chat:
                prompt_tokens = self.s.counter.chat(list(req["messages"]))
            else:
                prompt_tokens = self.s.counter.completion(str(req["prompt"]))
        except (KeyError, TypeError, ValueError) as e:
            self._write(_error(400, f"bad request: {e}", "invalid_request_error"))
            return self._done()
        n = max(1, n)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if not req.get("stream"):
            reply = _response(200, json.dumps(self.s.replies.whole(chat, n, usage)).encode())
            self._later(cfg.ttft_ms + cfg.itl_ms * (n - 1), lambda: (self._write(reply), self._done()))
            return
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        self._stream(chat, n, usage if include_usage else None)

    def _later(self, ms: float, fn: Callable[[], Any]) -> None:
        """Run fn no sooner than `ms` from now (by time.monotonic: an event loop's cached
        clock may fire a timer early, and a programmed delay must be a lower bound)."""
        if ms <= 0:
            fn()
            return
        self._at(time.monotonic() + ms / 1000.0, fn)

    def _at(self, due: float, fn: Callable[[], Any]) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def fire() -> None:
            if handle in self.timers:
                self.timers.remove(handle)
            if self.transport is None:
                return
            if time.monotonic() < due:
                self._at(due, fn)
            else:
                fn()

        handle = loop.call_later(max(0.0, due - time.monotonic()), fire)
        self.timers.append(handle)

    def _stream(self, chat: bool, n: int, usage: dict | None) -> None:
        r = self.s.replies
        cfg = self.s.cfg
        self._write(_STREAM_HEAD)
        if cfg.itl_ms <= 0:
            body = (r.chat_role if chat else b"") + b"".join(r.token(chat, i) for i in range(n)) + r.finish(chat, usage)
            self._later(cfg.ttft_ms, lambda: (self._write(body), self._done()))
            return

        def emit(i: int) -> None:
            piece = r.token(chat, i)
            if i == 0 and chat:
                piece = r.chat_role + piece
            if i == n - 1:
                self._write(piece + r.finish(chat, usage))
                self._done()
                return
            self._write(piece)
            # Each gap is measured from the token actually sent, so none is shorter than ITL.
            self._later(cfg.itl_ms, lambda: emit(i + 1))

        self._later(cfg.ttft_ms, lambda: emit(0))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fake-server", help="a fast OpenAI-compatible fake server with programmed delays",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--model", default="fake-model", help="model name served (default: fake-model)")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token (default: 0)")
    p.add_argument("--itl-ms", type=float, default=0.0, help="delay between tokens (default: 0)")
    p.add_argument("--osl", type=int, default=16, help="tokens when the request sets no max_tokens (default: 16)")
    p.add_argument("--fail-every", type=int, default=0,
                   help="answer every N-th generation request with a 500 (default: 0, never)")
    p.add_argument("--tokenizer", default=None,
                   help="count usage.prompt_tokens with this tokenizer (default: word count)")


def run(args: argparse.Namespace) -> int:
    cfg = FakeServerConfig(host=args.host, port=args.port, model=args.model, ttft_ms=args.ttft_ms,
                           itl_ms=args.itl_ms, osl=args.osl, fail_every=args.fail_every,
                           tokenizer=args.tokenizer)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        server = FakeServer(cfg)
        port = await server.start()
        print(f"fake server on http://{cfg.host}:{port} model={cfg.model}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    return 0
