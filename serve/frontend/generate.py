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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import msgspec

from serve import protocol as p
from serve.errors import WorkerError, WorkerRefused
from serve.frontend.metrics import FrontendMetrics
from serve.frontend.ndjson import NdjsonLines
from kvtransfer.protocol import TransferParams
from serve.frontend.pool import WorkerEntry, WorkerPool
from serve.frontend.prefillgate import PrefillGate
from serve.frontend.routing import RoutePlan, Routing
from serve.frontend.timing import RequestTiming
from serve.frontend.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("pdserve.frontend")


@dataclass
class Prefilled:
    """What a prefill worker returned: where its KV is held, its prefix-cache hits, and the
    token it sampled (with its finish reason: "stop" for EOS or a stop token, else "length")."""

    params: TransferParams
    cached: int
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class TextEvent:
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Generation:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, tokenizer: Tokenizer,
                 metrics: FrontendMetrics, read_timeout_s: float, connect_timeout_s: float,
                 routing: Routing, prefill_timeout_s: float, first_token_from: str = "prefill",
                 gate: PrefillGate | None = None) -> None:
        self.pool = pool
        self.gate = gate  # --max-prefills-per-worker: split requests wait here for a prefill worker with room
        self.first_token_from = first_token_from
        self.routing = routing
        self.prefill_timeout_s = prefill_timeout_s
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._decode_delta = p.decoder(p.TokenDelta)

    async def run(self, request_id: str, prompt_ids: list[int], sampling: p.SamplingOptions,
                  stop: list[str] | None, deadline: float,
                  received: float | None = None, timing: RequestTiming | None = None) -> AsyncIterator[TextEvent]:
        """The request's text events; the first one comes with its first token (its text may
        be empty while the detokenizer waits for more). `received`: when the frontend got the
        request (monotonic; default now), where its TTFT starts, whatever the path. `timing`:
        the request's stage breakdown so far (serve.frontend.timing), completed here."""
        received = time.monotonic() if received is None else received
        timing = timing if timing is not None else RequestTiming(received)
        timing.start("route")
        plan = self.routing.plan(prompt_ids)
        timing.stop("route")
        timing.path = plan.reason
        kv_transfer = None
        prefill_cached: int | None = None
        keep_first = self.first_token_source(sampling.seed) == "prefill"
        detok = IncrementalDetokenizer(self.tokenizer, stop)
        decode_ids, decode_sampling = prompt_ids, sampling
        first = _First(received)
        done: Prefilled | None = None
        if plan.prefill is not None:
            timing.start("prefill")
            until = min(time.monotonic() + self.prefill_timeout_s, deadline)  # the stage's budget, gate included
            admitted = plan if self.gate is None else await self.gate.admit(plan, until - time.monotonic())
            if admitted is None:  # no prefill worker had room in time: as a prefill timeout
                log.warning("request %s: no prefill worker had room in time; decode worker prefills", request_id)
                self.metrics.prefill_fallbacks.labels("timeout").inc()
            else:
                plan = admitted
                done = await self._prefill(plan, request_id, prompt_ids, sampling, until, keep_first)
            took = timing.stop("prefill")
            if done is not None:
                kv_transfer, prefill_cached = done.params, done.cached
                self.routing.costs.observe_prefill(plan.prefill.url, len(prompt_ids) - done.cached, took)
            plan = self.routing.decode_for(plan, len(prompt_ids))  # by the load now, not at arrival
        elif plan.is_fallback:
            self.metrics.prefill_fallbacks.labels("no_prefill_worker").inc()
        self._observe_plan(plan)
        # Whether a decode worker got the request (it then reads the held KV, or releases it
        # when it ends first); until then the prefill's blocks are this request's to free.
        handed_over = kv_transfer is None
        try:
            if done is not None and keep_first and done.token_ids:
                event = first.take(done, detok, sampling, len(prompt_ids))
                self._first_token(timing, first.at)
                if event.finish_reason is not None:
                    # Nothing left for a decode worker: free the prefill's blocks now.
                    handed_over = True
                    await self._release(plan.prefill, request_id)
                    yield event
                    return
                yield event
                decode_ids = [*prompt_ids, *done.token_ids]
                decode_sampling = msgspec.structs.replace(
                    sampling, max_tokens=sampling.max_tokens - first.tokens,
                    min_tokens=max(0, sampling.min_tokens - first.tokens))
            body = p.encode(p.GenerateRequest(request_id=request_id, prompt_token_ids=decode_ids,
                                              sampling=decode_sampling, kv_transfer=kv_transfer))
            tried: set[str] = set()
            worker = plan.decode
            while True:
                tried.add(worker.url)
                started = False
                try:
                    with self.routing.load.reserve(worker.url, "decode", plan.prompt_blocks):
                        handed_over = True
                        async for event in self._stream(worker, request_id, body, detok, deadline, len(prompt_ids),
                                                        first, timing, after_prefill=plan.prefill is not None,
                                                        observe=self._observer(plan, worker, kv_transfer)):
                            started = True
                            if event.finish_reason is not None and prefill_cached is not None:
                                # The decode engine counts transferred tokens as cached; the client's
                                # cached tokens are the prefill engine's prefix-cache hits.
                                event.cached_tokens = prefill_cached
                            yield event
                    return
                except (httpx.ConnectError, httpx.ConnectTimeout, WorkerRefused) as exc:
                    # Nothing reached the engine (unreachable, or no connection within the connect
                    # timeout: a host too busy to accept; or refused: draining, engine not up):
                    # another worker may take it, with the same prompt, token and transfer params.
                    handed_over = kv_transfer is None
                    if isinstance(exc, WorkerRefused):
                        log.info("request %s: worker %s refused it (%s); trying another", request_id, worker.url, exc)
                    else:
                        self.pool.report_failure(worker.url)
                        log.warning("request %s: worker %s unreachable (%r)", request_id, worker.url, exc)
                    if started:
                        raise WorkerError(f"worker {worker.url} unreachable") from exc
                worker = self.routing.next_worker(plan.decode_roles, tried, len(prompt_ids))
        finally:
            if not handed_over and plan.prefill is not None:
                # The client left, or no decode worker could be reached, before any decode
                # worker had the request: free the prefill's blocks now, not at lease end.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._release(plan.prefill, request_id))

    def _observer(self, plan: RoutePlan, worker: WorkerEntry,
                  kv_transfer: TransferParams | None) -> Callable[[float, float | None], None] | None:
        """What the decode stream's first token tells the split estimates (`router.split`):
        with remote KV, its wait for the bytes it read from the holder; without, the worker's
        own prefill of the prompt's uncached part (a conditional or fallback path)."""
        costs = self.routing.costs
        if kv_transfer is not None and plan.prefill is not None:
            if worker is not plan.decode or not plan.transfer_bytes:  # a retry's cache, or a size, unknown here
                return None
            holder, nbytes = plan.prefill.url, plan.transfer_bytes

            def transfer(took: float, kv_load_s: float | None) -> None:
                if kv_load_s is not None:  # a worker without per-request stats says nothing: learn nothing
                    costs.observe_transfer(holder, nbytes, min(took, kv_load_s))

            return transfer
        if plan.reason != "agg" and worker is plan.decode:  # another worker's (a retry's) cache is unknown here
            tokens = plan.uncached_tokens
            return lambda took, kv_load_s: costs.observe_prefill(worker.url, tokens, took)
        return None

    def _first_token(self, timing: RequestTiming, at: float) -> None:
        timing.first_token(at)
        self.metrics.ttft.observe(timing.ttft)
        for stage, seconds in timing.stages.items():
            self.metrics.stages.labels(stage).observe(seconds)

    def first_token_source(self, seed: int | None) -> str:
        """Which worker gives a split request its first token. "prefill": its token goes to
        the client at once and the decode worker continues after it; "decode": the decode
        worker regenerates it (--first-token-from decode, or a seeded request: a seeded
        sampler on the decode engine would start its draws afresh, away from an unsplit
        request's)."""
        return "prefill" if self.first_token_from == "prefill" and seed is None else "decode"

    def _observe_plan(self, plan: RoutePlan) -> None:
        m = self.metrics
        pd, dd = plan.prefill_decision, plan.decode_decision
        if pd is not None:
            m.router_decisions.labels("prefill", pd.worker_id).inc()
            m.router_cached_ratio.observe(pd.cached_ratio)
        if dd is not None:
            m.router_decisions.labels("decode", dd.worker_id).inc()
        m.paths.labels(plan.reason).inc()

    async def _release(self, worker: WorkerEntry, request_id: str) -> None:
        """Ask a prefill worker to free the blocks it holds for `request_id` (its lease frees
        them anyway if this fails)."""
        try:
            r = await self.client.post(f"{worker.url}/kv/release", content=p.encode(p.ReleaseRequest(request_id)),
                                       headers={"content-type": "application/json"}, timeout=2.0)
            if r.status_code != 200:
                log.warning("request %s: release on %s: HTTP %d", request_id, worker.url, r.status_code)
        except (httpx.HTTPError, OSError) as exc:
            log.warning("request %s: release on %s failed (%s); its lease frees the blocks", request_id,
                        worker.url, exc)

    async def _prefill(self, plan: RoutePlan, request_id: str, prompt_ids: list[int], sampling: p.SamplingOptions,
                       until: float, keep_first: bool = False) -> Prefilled | None:
        """Run the prompt on the prefill worker by `until` (monotonic) and return its transfer
        params; on any failure (error, timeout, unreachable) count a fallback and return None:
        the decode worker prefills. With the gate, the load it reserved is released here."""
        worker = plan.prefill
        if worker is None:
            raise ValueError("a prefill stage without a prefill worker")
        held = contextlib.nullcontext() if self.gate is not None else \
            self.routing.load.reserve(worker.url, "prefill", plan.prompt_blocks)
        try:
            with held:
                reason = await self._prefill_on(worker, request_id, prompt_ids, sampling, until, keep_first)
        finally:
            if self.gate is not None:
                self.routing.load.release(worker.url, "prefill", plan.prompt_blocks)
                self.gate.kick()
        if isinstance(reason, Prefilled):
            return reason
        log.warning("request %s: prefill on %s failed (%s); decode worker prefills locally",
                    request_id, worker.url, reason)
        self.metrics.prefill_fallbacks.labels(reason).inc()
        return None

    async def _prefill_on(self, worker: WorkerEntry, request_id: str, prompt_ids: list[int],
                          sampling: p.SamplingOptions, until: float, keep_first: bool) -> Prefilled | str:
        """The transfer params, cached tokens and token of a prefill, or why it failed. A token
        the client will see honours its min_tokens (no EOS when min_tokens >= 1)."""
        body = p.encode(p.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, remote_decode=True,
            sampling=msgspec.structs.replace(sampling, max_tokens=1,
                                             min_tokens=min(sampling.min_tokens, 1) if keep_first else 0)))
        timeout = max(0.1, until - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                r = await self.client.post(f"{worker.url}/generate", content=body,
                                           headers={"content-type": "application/json", "x-request-id": request_id},
                                           timeout=httpx.Timeout(timeout, connect=self.connect_timeout_s))
                if r.status_code != 200:
                    raise WorkerError(f"HTTP {r.status_code}: {r.text[:200]}")
                params, cached, tokens, reason = None, 0, [], None
                for line in r.content.splitlines():
                    if line:
                        delta = self._decode_delta(line)
                        if delta.error is not None:
                            raise WorkerError(delta.error)
                        params = delta.kv_transfer or params
                        cached = delta.num_cached_tokens if delta.num_cached_tokens is not None else cached
                        tokens += delta.token_ids
                        reason = delta.finish_reason or reason
                if params is None:
                    raise WorkerError("prefill finished without KV transfer params")
                return Prefilled(params, cached, tokens[:1], reason)
        except TimeoutError:
            return "timeout"
        except (httpx.ConnectError, httpx.ConnectTimeout):  # no connection: nothing was sent
            self.pool.report_failure(worker.url)
            return "unreachable"
        except (WorkerError, httpx.HTTPError, msgspec.DecodeError) as exc:
            if not isinstance(exc, WorkerError):
                self.pool.report_failure(worker.url)
            log.warning("request %s: prefill on %s failed: %s", request_id, worker.url, str(exc) or type(exc).__name__)
            return "error"

    async def _stream(self, worker: WorkerEntry, request_id: str, body: bytes, detok: IncrementalDetokenizer,
                      deadline: float, n_prompt: int, first: _First, timing: RequestTiming,
                      after_prefill: bool,
                      observe: Callable[[float, float | None], None] | None = None) -> AsyncIterator[TextEvent]:
        """One worker's stream, after the tokens `first` already gave the client (the
        prefill's). A retry on another worker happens only before this stream's first token
        (`run`), so TTFT is observed once per request."""
        finished = False
        completion = first.tokens
        cached = 0
        last = first.at
        first_token_at: float | None = first.at if first.tokens else None
        timeout = httpx.Timeout(connect=self.connect_timeout_s, read=self.read_timeout_s, write=10.0, pool=10.0)
        sent = time.monotonic()
        kv_load_s: float | None = None  # the decode worker's reported wait for the KV (None: not reported)
        try:
            async with self.client.stream("POST", f"{worker.url}/generate", content=body, timeout=timeout,
                                          headers={"content-type": "application/json",
                                                   "x-request-id": request_id}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode(errors="replace")
                    kind = WorkerRefused if resp.status_code == 503 else WorkerError
                    raise kind(f"worker {worker.url} answered HTTP {resp.status_code}: {text}")
                lines = NdjsonLines(resp, self.read_timeout_s)
                while True:
                    try:
                        line = await lines.next(deadline)
                    except StopAsyncIteration:
                        raise WorkerError(f"worker {worker.url} closed the stream before finishing") from None
                    try:
                        delta = self._decode_delta(line)
                    except msgspec.DecodeError as exc:
                        raise WorkerError(f"worker {worker.url} sent a malformed line: {exc}") from None
                    if delta.error is not None:
                        raise WorkerError(delta.error)
                    if delta.num_cached_tokens is not None:
                        cached = delta.num_cached_tokens
                    if delta.kv_load_s is not None:
                        kv_load_s = delta.kv_load_s
                    now = time.monotonic()
                    is_first = False
                    if delta.token_ids:
                        if observe is not None:  # this worker's first token (after the prefill's, if any)
                            observe(now - sent, kv_load_s)
                            observe = None
                        if first_token_at is None:
                            first_token_at = now
                            is_first = True
                            took = now - sent
                            if after_prefill:  # the decode worker's share: its KV wait, then its first step
                                kv = min(took, kv_load_s or 0.0)
                                timing.add("kv_transfer", kv)
                                timing.add("decode_first_step", took - kv)
                            else:  # the one worker's prefill (and first step)
                                timing.add("prefill", took)
                            self._first_token(timing, now)
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
                        # Read the response's end, so its connection goes back to the pool (a
                        # response left unread closes it: a new connection per request).
                        await lines.drain()
                        return
                    if text or is_first:
                        yield TextEvent(text)
        finally:
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


class _First:
    """The first token when the prefill worker's sampled one is kept: the client's event for
    it, and when it came (`at`; the request's arrival until then)."""

    def __init__(self, received: float) -> None:
        self.at = received
        self.tokens = 0

    def take(self, done: Prefilled, detok: IncrementalDetokenizer, sampling: p.SamplingOptions,
             n_prompt: int) -> TextEvent:
        self.at = time.monotonic()
        self.tokens = len(done.token_ids)
        text = detok.add(done.token_ids)
        if detok.stopped:  # a stop string
            return TextEvent(text, "stop", n_prompt, self.tokens, done.cached)
        if done.finish_reason == "stop" or self.tokens >= sampling.max_tokens:  # EOS/stop token, or max_tokens
            reason = "stop" if done.finish_reason == "stop" else "length"
            return TextEvent(text + detok.finish(), reason, n_prompt, self.tokens, done.cached)
        return TextEvent(text)
