"""Subscribes to each worker's vLLM KV events (ZMQ PUB) and feeds the router's prefix index.

One asyncio task per worker endpoint; a worker that goes away has its task cancelled and
its blocks dropped from the index. Malformed batches are counted and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import zmq
import zmq.asyncio

from router.events import decode_batch
from router.index import PrefixIndex

log = logging.getLogger("pdserve.frontend.kv_events")


class KVEventSubscriber:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.ctx = zmq.asyncio.Context.instance()
        self.tasks: dict[str, tuple[str, asyncio.Task]] = {}
        self.batches = 0
        self.errors = 0

    def ensure(self, worker_id: str, endpoint: str) -> None:
        current = self.tasks.get(worker_id)
        if current is not None and current[0] == endpoint and not current[1].done():
            return
        if current is not None:
            current[1].cancel()
            if current[0] != endpoint:
                self.index.remove_worker(worker_id)  # a new engine behind this worker: its cache starts empty
        self.tasks[worker_id] = (endpoint, asyncio.create_task(self._run(worker_id, endpoint)))

    def drop(self, worker_id: str) -> None:
        current = self.tasks.pop(worker_id, None)
        if current is not None:
            current[1].cancel()
        self.index.remove_worker(worker_id)

    async def _run(self, worker_id: str, endpoint: str) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        try:
            while True:
                parts = await sock.recv_multipart()
                try:
                    batch = decode_batch(parts[-1])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self.errors += 1
                    log.warning("bad KV event batch from %s: %s", worker_id, exc)
                    continue
                self.batches += 1
                for ev in batch.events:
                    self.index.apply(worker_id, ev)
        finally:
            sock.close(linger=0)

    async def stop(self) -> None:
        for _, task in self.tasks.values():
            task.cancel()
        for _, task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
