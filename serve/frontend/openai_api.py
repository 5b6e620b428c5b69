"""The OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models.

A request is admitted (bounded queue, before its body is read), parsed, preprocessed
(`preprocess`, pure), generated (`Generation`) and rendered as typed bodies or SSE chunks
(`responses`). Errors are OpenAI envelopes; after a stream started they are sent as
`data: {"error": ...}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from serve.errors import NoWorkerAvailable, WorkerError
from serve.frontend import openai_protocol as oai
from serve.frontend import preprocess
from serve.frontend import responses as r
from serve.frontend.admission import Overloaded, Ticket
from serve.frontend.errors import APIError, bad_request, error_response, sse_error
from serve.frontend.generate import TextEvent
from serve.frontend.timing import HEADER as TIMING_HEADER
from serve.frontend.timing import RequestTiming
from serve.http import DisconnectAwareStreamingResponse, cancel_on_disconnect

if TYPE_CHECKING:
    from serve.frontend.app import Frontend

log = logging.getLogger("pdserve.frontend")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
JSON = "application/json"


def unavailable(exc: Exception, retry_after_s: int) -> APIError:
    return APIError(503, str(exc), "service_unavailable", None, "no_worker_available",
                    headers={"retry-after": str(retry_after_s)})


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refused past `limit` bytes (413) whether declared or streamed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       "invalid_request_error", None, "request_too_large")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                               "invalid_request_error", None, "request_too_large")
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection while sending its body",
                       "invalid_request_error", None, "client_closed_request") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None


DISCARD_MAX_BYTES = 64 * 1024


async def discard_small_body(request: Request, timeout_s: float = 1.0) -> None:
    """Read and drop a small declared body before refusing the request: closing a connection
    with unread bytes makes the kernel reset it, and the client may then see the reset
    instead of the 429. A large (or undeclared) body is not read: refusing a flood must not
    cost its bodies."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit() or int(declared) > DISCARD_MAX_BYTES:
        return
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in request.stream():
                pass
    except (TimeoutError, ClientDisconnect):
        pass


def request_model(body: Any) -> tuple[str, type]:
    """(kind, pydantic model) of a body: chat when it has `messages`."""
    kind = "chat" if isinstance(body, dict) and "messages" in body else "completions"
    return kind, oai.ChatCompletionRequest if kind == "chat" else oai.CompletionRequest


class OpenAIApi:
    def __init__(self, fe: Frontend) -> None:
        self.fe = fe

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    async def models(self) -> Response:
        fe = self.fe
        card = r.ModelCard(id=fe.settings.served_model_name, created=r.now(), root=fe.settings.model)
        if (mml := fe.pool.max_model_len()) is not None:
            card = r.ModelCard(id=card.id, created=card.created, root=card.root, max_model_len=mml)
        return Response(r.encode(r.ModelList(data=[card])), media_type=JSON)

    def prompt_ids(self, req: Any, kind: str) -> list[int]:
        return preprocess.prompt_ids(self.fe.tokenizer, req, kind)

    # -- the request path ---------------------------------------------------------------
    async def _handle(self, request: Request, kind: str) -> Response:
        received = time.monotonic()  # headers in: TTFT and duration count from here, in every path
        fe = self.fe
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        fe.requests.arrived()  # demand, refused or not
        try:  # before the body is read: a flood is refused at the door
            ticket = fe.admission.enter()
        except Overloaded as exc:
            fe.requests.record(received, 0, 0, None, False)
            fe.metrics.rejected.labels("overloaded").inc()
            self._count(endpoint, False, 429)
            await discard_small_body(request)
            return error_response(APIError(429, str(exc), "rate_limit_error", None, "server_overloaded",
                                           headers={"retry-after": str(fe.settings.retry_after_s)}))
        handed_over = False
        try:
            response = await self._admitted(request, kind, endpoint, ticket, received)
            handed_over = isinstance(response, DisconnectAwareStreamingResponse)
            return response
        finally:
            if not handed_over:
                ticket.release()

    async def _admitted(self, request: Request, kind: str, endpoint: str, ticket: Ticket,
                        received: float) -> Response:
        fe = self.fe
        s = fe.settings
        stream = False
        deadline = received + s.request_timeout_s
        timing = RequestTiming(received)
        try:
            body = await read_json(request, s.max_body_bytes)
            req = oai.parse(oai.ChatCompletionRequest if kind == "chat" else oai.CompletionRequest, body)
            stream = req.stream
            req.check_supported()
            if req.model != s.served_model_name:
                raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model",
                               "model_not_found")
            timing.start("tokenize")
            prompt_ids = self.prompt_ids(req, kind)
            timing.stop("tokenize")
            limit = fe.pool.max_model_len()
            if limit is None or not fe.pool.available():
                raise NoWorkerAvailable("no worker available")
            sampling = preprocess.sampling_options(req, len(prompt_ids), limit, fe.pool.seeds_supported())
            try:
                timing.start("queue")
                await ticket.wait(min(deadline, time.monotonic() + s.queue_timeout_s))
                timing.stop("queue")
            except TimeoutError:
                fe.metrics.rejected.labels("queue_timeout").inc()
                raise APIError(504, "the request timed out waiting for a free slot (the server is at capacity)",
                               "timeout_error", None, "queue_timeout") from None
        except APIError as err:
            self._count(endpoint, stream, err.status)
            return error_response(err)
        except NoWorkerAvailable as exc:
            self._count(endpoint, stream, 503)
            return error_response(unavailable(exc, s.retry_after_s))
        request_id = request.headers.get("x-request-id") or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        events = fe.generation.run(request_id, prompt_ids, sampling, req.stop, deadline, received, timing)
        headers = {"x-request-id": request_id}
        show_timing = request.headers.get(TIMING_HEADER, "").strip() == "1"
        if stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body_iter = self._sse(kind, request_id, events, include_usage, endpoint, received, timing, show_timing,
                                  len(prompt_ids))
            return DisconnectAwareStreamingResponse(body_iter, media_type="text/event-stream",
                                                    headers={**SSE_HEADERS, **headers}, on_close=ticket.release)
        result = await cancel_on_disconnect(request, self._collect(kind, request_id, events, endpoint, received,
                                                                   timing, len(prompt_ids)))
        if result is None:  # the client went away; the generation was cancelled and aborted
            self._count(endpoint, False, 499)
            return Response(status_code=499)
        if isinstance(result, APIError):
            return error_response(result)
        if show_timing:
            headers[TIMING_HEADER] = msgspec.json.encode(timing.to_dict()).decode()
        return Response(r.encode(result), media_type=JSON, headers=headers)

    def _failure(self, exc: Exception) -> APIError:
        if isinstance(exc, NoWorkerAvailable):
            return unavailable(exc, self.fe.settings.retry_after_s)
        if isinstance(exc, asyncio.TimeoutError):
            return APIError(504, "the request timed out", "timeout_error", None, "timeout")
        if isinstance(exc, WorkerError | httpx.HTTPError):
            why = str(exc) or type(exc).__name__  # httpx's ReadError has no message
            return APIError(502, f"worker failed: {why}", "server_error", None, "worker_error")
        log.exception("unexpected error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error", None, "internal_error")

    def _count(self, endpoint: str, stream: bool, status: int) -> None:
        self.fe.metrics.requests.labels(endpoint, self.fe.settings.served_model_name,
                                        "stream" if stream else "unary", str(status)).inc()

    def _observe(self, t0: float, last: TextEvent | None, timing: RequestTiming, n_prompt: int, ok: bool) -> None:
        m = self.fe.metrics
        m.duration.observe(time.monotonic() - t0)
        done = last is not None and last.finish_reason is not None
        if last is not None and done:
            m.isl.observe(last.prompt_tokens)
            m.osl.observe(last.completion_tokens)
            m.cached.inc(last.cached_tokens)
        self.fe.requests.record(t0, n_prompt, last.completion_tokens if last is not None else 0, timing.ttft,
                                ok and done)

    async def _collect(self, kind: str, request_id: str, events: AsyncIterator[TextEvent],
                       endpoint: str, t0: float, timing: RequestTiming, n_prompt: int) -> Any:
        fe = self.fe
        fe.metrics.inflight.inc()
        fe.active += 1
        parts: list[str] = []
        last: TextEvent | None = None
        try:
            async for ev in events:
                parts.append(ev.text)
                last = ev
        except Exception as exc:
            err = self._failure(exc)
            self._count(endpoint, False, err.status)
            log.warning("request %s failed: %s", request_id, err.message)
            fe.requests.record(t0, n_prompt, 0, timing.ttft, False)
            return err
        finally:
            fe.metrics.inflight.dec()
            fe.active -= 1
            await events.aclose()
        self._observe(t0, last, timing, n_prompt, True)
        self._count(endpoint, False, 200)
        if last is None:
            return APIError(502, "worker failed: the generation ended without a result", "server_error", None,
                            "worker_error")
        usage = r.Usage.of(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        return r.final_body(kind, request_id, fe.settings.served_model_name, "".join(parts), last.finish_reason,
                            usage)

    async def _sse(self, kind: str, request_id: str, events: AsyncIterator[TextEvent], include_usage: bool,
                   endpoint: str, t0: float, clock: RequestTiming, show_timing: bool,
                   n_prompt: int) -> AsyncIterator[bytes]:
        """The SSE body. As vLLM's server does, nothing is sent before the first token: a
        chat's role chunk goes out with it, so a client's TTFT is the first chunk's arrival.
        With `timing` (the client sent X-PDSERVE-Timing: 1), the last chunk before [DONE]
        carries the stage breakdown as `pdserve_timing`."""
        fe = self.fe
        timing = clock if show_timing else None
        out = r.ChunkWriter(kind, request_id, fe.settings.served_model_name, include_usage)
        fe.metrics.inflight.inc()
        fe.active += 1
        last: TextEvent | None = None
        status = 200
        try:
            async for ev in events:
                if last is None and kind == "chat":
                    yield out.role()
                last = ev
                if ev.text or ev.finish_reason:
                    final = ev.finish_reason is not None and not include_usage
                    yield out.text(ev.text, ev.finish_reason,
                                   timing.to_dict() if final and timing is not None else msgspec.UNSET)
            if include_usage and last is not None:
                yield out.usage(r.Usage.of(last.prompt_tokens, last.completion_tokens, last.cached_tokens),
                                timing.to_dict() if timing is not None else msgspec.UNSET)
            yield r.DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        except Exception as exc:
            err = self._failure(exc)
            status = err.status
            log.warning("request %s failed mid-stream: %s", request_id, err.message)
            yield sse_error(err)
        finally:
            fe.metrics.inflight.dec()
            fe.active -= 1
            with contextlib.suppress(Exception):
                await events.aclose()
            self._observe(t0, last, clock, n_prompt, status == 200)
            self._count(endpoint, True, status)
