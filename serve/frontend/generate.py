"""One generation on one worker, as a stream of text events.

`Generation.run` sends the token ids to a worker chosen by the pool, reads its NDJSON
token stream, detokenizes incrementally, applies stop strings, and yields `TextEvent`s;
the last one carries the finish reason and the usage. Every wait is bounded: the next
token by the worker read timeout, the whole request by the request deadline. Leaving
early (stop string, client gone, timeout) closes the worker stream, which aborts the
request in the engine; an explicit /abort follows as a second line of defence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec

from serve import protocol as p
from serve.errors import NoWorkerAvailable, WorkerError
from serve.frontend.metrics import FrontendMetrics
from serve.frontend.pool import WorkerEntry, WorkerPool
from serve.frontend.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("pdserve.frontend")


@dataclass
class TextEvent:
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Generation:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, tokenizer: Tokenizer,
                 metrics: FrontendMetrics, read_timeout_s: float, connect_timeout_s: float) -> None:
        self.pool = pool
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._decode_delta = p.decoder(p.TokenDelta)

    async def run(self, request_id: str, prompt_ids: list[int], sampling: p.SamplingOptions,
                  stop: list[str] | None, deadline: float) -> AsyncIterator[TextEvent]:
        body = p.encode(p.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling))
        detok = IncrementalDetokenizer(self.tokenizer, stop)
        tried: set[str] = set()
        while True:
            worker = self._pick(tried)
            tried.add(worker.url)
            started = False
            try:
                async for event in self._stream(worker, request_id, body, detok, deadline, len(prompt_ids)):
                    started = True
                    yield event
                return
            except httpx.ConnectError as exc:
                # Nothing reached the engine: another worker may take it.
                self.pool.report_failure(worker.url)
                log.warning("request %s: worker %s unreachable (%s)", request_id, worker.url, exc)
                if started:
                    raise WorkerError(f"worker {worker.url} unreachable") from exc

    def _pick(self, tried: set[str]) -> WorkerEntry:
        candidates = [w for w in self.pool.available() if w.url not in tried]
        if not candidates:
            raise NoWorkerAvailable("no worker available")
        if len(candidates) == len(self.pool.available()):
            return self.pool.pick()
        return candidates[0]

    async def _stream(self, worker: WorkerEntry, request_id: str, body: bytes, detok: IncrementalDetokenizer,
                      deadline: float, n_prompt: int) -> AsyncIterator[TextEvent]:
        worker.inflight += 1
        finished = False
        completion = 0
        cached = 0
        t0 = time.monotonic()
        last = t0
        first_token_at: float | None = None
        timeout = httpx.Timeout(connect=self.connect_timeout_s, read=self.read_timeout_s, write=10.0, pool=10.0)
        try:
            async with self.client.stream("POST", f"{worker.url}/generate", content=body, timeout=timeout,
                                          headers={"content-type": "application/json",
                                                   "x-request-id": request_id}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode(errors="replace")
                    raise WorkerError(f"worker {worker.url} answered HTTP {resp.status_code}: {text}")
                lines = resp.aiter_lines()
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise asyncio.TimeoutError()
                    try:
                        line = await asyncio.wait_for(anext(lines), min(remaining, self.read_timeout_s))
                    except StopAsyncIteration:
                        raise WorkerError(f"worker {worker.url} closed the stream before finishing") from None
                    if not line:
                        continue
                    try:
                        delta = self._decode_delta(line)
                    except msgspec.DecodeError as exc:
                        raise WorkerError(f"worker {worker.url} sent a malformed line: {exc}") from None
                    if delta.error is not None:
                        raise WorkerError(delta.error)
                    if delta.num_cached_tokens is not None:
                        cached = delta.num_cached_tokens
                    now = time.monotonic()
                    if delta.token_ids:
                        if first_token_at is None:
                            first_token_at = now
                            self.metrics.ttft.observe(now - t0)
                        else:
                            gap = (now - last) / len(delta.token_ids)
                            for _ in delta.token_ids:
                                self.metrics.itl.observe(gap)
                        last = now
                    completion += len(delta.token_ids)
                    text = detok.add(delta.token_ids)
                    if detok.stopped:
                        finished = True
                        yield TextEvent(text, "stop", n_prompt, completion, cached)
                        return
                    if delta.finished:
                        finished = True
                        text += detok.finish()
                        yield TextEvent(text, delta.finish_reason or "stop", n_prompt, completion, cached)
                        return
                    if text:
                        yield TextEvent(text)
        finally:
            worker.inflight -= 1
            if not finished:
                await self._abort(worker, request_id)
            elif detok.stopped:
                await self._abort(worker, request_id)

    async def _abort(self, worker: WorkerEntry, request_id: str) -> None:
        """Closing the stream already aborts; this covers a worker that missed the close."""
        with contextlib.suppress(Exception):
            await asyncio.shield(self.client.post(
                f"{worker.url}/abort", content=p.encode(p.AbortRequest(request_id=request_id)),
                headers={"content-type": "application/json"}, timeout=2.0))
