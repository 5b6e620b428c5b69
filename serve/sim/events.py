"""KV cache events of a simulated engine, published as vLLM publishes them: a ZMQ PUB
socket sending (topic, sequence, msgpack `EventBatch`), so the router's real subscriber
consumes them unchanged."""

from __future__ import annotations

import time

import msgspec
import zmq

from router.events import Event, EventBatch


class EventPublisher:
    def __init__(self, endpoint: str) -> None:
        """`endpoint`: where to bind (`ipc://...` or `tcp://*:PORT`)."""
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.pending: list[Event] = []
        self.seq = 0
        self._enc = msgspec.msgpack.Encoder()

    def add(self, event: Event) -> None:
        self.pending.append(event)

    def flush(self) -> None:
        if not self.pending:
            return
        batch = EventBatch(ts=time.time(), events=self.pending)
        self.pending = []
        try:
            self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), self._enc.encode(batch)], flags=zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeping up: PUB drops, as vLLM's does
            pass
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
