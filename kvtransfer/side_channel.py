"""The side channel: a small ZMQ request/reply service beside each engine's NIXL agent.

The server thread answers `Hello` with this engine's `EngineMetadata` (the handshake),
and `Acquire` / `Release` / `Push` through callbacks into the holder. Clients time out on
every call (`timeout_s`) and then discard their socket, so a dead peer costs one timeout,
never a hang. The server binds to the address it is given (loopback by default). With a
cluster token, every message must carry its HMAC for the sender's engine id: an engine
outside the cluster is refused (and logged once).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import msgspec
import zmq

from kvtransfer.errors import HandshakeError
from kvtransfer.protocol import (PROTOCOL_VERSION, Acquire, EngineMetadata, Hello, Message, Push, Release, Reply,
                                 authorized, engine_auth)

log = logging.getLogger("vllm.pdserve.kvtransfer.side_channel")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_ctx: zmq.Context | None = None
_ctx_lock = threading.Lock()


def context() -> zmq.Context:
    """kvtransfer's own ZMQ context, its I/O thread allowed on every core.

    The engine process is pinned to its core(s), and a context made there would run its
    I/O thread there too, behind spinning OpenMP threads: side-channel answers then took
    seconds on a shared core (measured: 5 s timeouts with two engines on one core).
    """
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = zmq.Context()
            for cpu in range(os.cpu_count() or 1):
                ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
            _ctx = ctx
        return _ctx


def unpin_thread() -> None:
    """Let the calling helper thread run on any core: the engine process may be pinned to
    one core that its spinning OpenMP threads keep busy, which would starve the side channel
    (and the holder's NIXL progress)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):
        pass


class SideChannelServer:
    def __init__(self, endpoint: str, metadata: Callable[[], EngineMetadata],
                 on_acquire: Callable[[Acquire], Reply], on_release: Callable[[Release], Reply],
                 token: str | None = None, on_hello: Callable[[Hello], None] | None = None,
                 on_push: Callable[[Push], Reply] | None = None) -> None:
        self.ctx = context()
        self._token = token
        self._refused: set[str] = set()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._metadata = metadata
        self._on_acquire = on_acquire
        self._on_release = on_release
        self._on_hello = on_hello
        self._on_push = on_push
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pdserve-kv-side-channel", daemon=True)
        self._thread.start()

    def _handle(self, raw: bytes) -> Reply:
        try:
            msg = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Reply("error", f"malformed message: {exc}")
        if isinstance(msg, Hello | Acquire | Release | Push) and not authorized(self._token, msg.engine_id, msg.auth):
            if msg.engine_id not in self._refused:  # once per engine: a retrying peer does not flood the log
                self._refused.add(msg.engine_id)
                log.warning("kvtransfer: refused %s from unregistered engine %r (no or wrong cluster token)",
                            type(msg).__name__.lower(), msg.engine_id)
            return Reply("error", "unauthorized: this engine does not hold the cluster token")
        if isinstance(msg, Hello):
            if msg.protocol_version != PROTOCOL_VERSION:
                return Reply("error", f"protocol version: local {PROTOCOL_VERSION} vs remote {msg.protocol_version}")
            if self._on_hello is not None:
                self._on_hello(msg)
            return Reply("ok", metadata=self._metadata())
        if isinstance(msg, Acquire):
            return self._on_acquire(msg)
        if isinstance(msg, Release):
            return self._on_release(msg)
        if isinstance(msg, Push):
            if self._on_push is None:
                return Reply("error", "this engine does not serve push transfers")
            return self._on_push(msg)
        return Reply("error", f"unexpected message {type(msg).__name__}")

    def _serve(self) -> None:
        unpin_thread()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                ident, _, raw = self.sock.recv_multipart()
            except ValueError:
                continue
            try:
                reply = self._handle(raw)
            except Exception as exc:  # a bug in a callback must not kill the channel
                log.exception("side channel handler failed")
                reply = Reply("error", f"{type(exc).__name__}: {exc}")
            self.sock.send_multipart([ident, b"", _encoder.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(linger=0)


class SideChannelClient:
    """One REQ socket per remote endpoint; recreated after a timeout (REQ is then stuck)."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = context()
        self.sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self.sock is None:
            s = self.ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            s.connect(self.endpoint)
            self.sock = s
        return self.sock

    def call(self, msg: Message) -> Reply:
        sock = self._socket()
        try:
            sock.send(_encoder.encode(msg))
            reply = _decoder.decode(sock.recv())
        except zmq.Again:
            self.close()
            raise HandshakeError(f"side channel {self.endpoint}: no answer in {self.timeout_ms} ms") from None
        except zmq.ZMQError as exc:
            self.close()
            raise HandshakeError(f"side channel {self.endpoint}: {exc}") from None
        if not isinstance(reply, Reply):
            raise HandshakeError(f"side channel {self.endpoint}: unexpected {type(reply).__name__}")
        return reply

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None


def release_once(endpoint: str, request_id: str, engine_id: str, token: str | None, timeout_s: float) -> Reply:
    """One `Release` of a held request (the holder's own id for it, `TransferParams.request_id`)
    on a fresh socket, signed for `engine_id` with the cluster token. Blocking: call it off the
    event loop. Raises HandshakeError when the holder does not answer in time."""
    client = SideChannelClient(endpoint, timeout_s)
    try:
        return client.call(Release(request_id=request_id, engine_id=engine_id, auth=engine_auth(token, engine_id)))
    finally:
        client.close()
