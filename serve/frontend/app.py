"""The frontend role: an OpenAI-compatible HTTP server in front of the workers.

`Frontend` owns the components and their lifecycle (tokenizer, HTTP client, worker pool,
routing with its load tracker, generation, KV-event subscriptions, admission);
`OpenAIApi` (`openai_api`) serves the OpenAI endpoints and `InternalApi` (`internal`)
the probes, metrics, drain, discovery and explain endpoints. `build_app` wires them into
FastAPI. Chat templates and tokenization happen here (the router needs token ids);
workers get token ids and stream token ids back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.auth import Gate, token_headers
from serve.common.origins import PerOriginTransport
from serve.frontend.admission import Admission
from serve.frontend.errors import APIError, bad_request, error_response
from serve.frontend.generate import Generation
from serve.frontend.internal import InternalApi
from serve.frontend.kv_events import KVEventSubscriber
from serve.frontend.loopstall import LoopStall
from serve.frontend.metrics import FrontendMetrics
from serve.frontend.requestlog import RequestLog
from serve.frontend.openai_api import OpenAIApi
from serve.frontend.pool import WorkerPool
from serve.frontend.prefillgate import PrefillGate
from serve.frontend.routing import Routing
from serve.frontend.settings import FrontendSettings
from serve.frontend.tokenizer import Tokenizer

log = logging.getLogger("pdserve.frontend")


class Frontend:
    def __init__(self, settings: FrontendSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = FrontendMetrics()
        self.requests = RequestLog()  # finished requests, exactly (GET /internal/requests)
        self.tokenizer: Tokenizer | None = None
        self.client: httpx.AsyncClient | None = None
        self.pool: WorkerPool | None = None
        self.generation: Generation | None = None
        self.routing: Routing | None = None
        self.prefill_gate: PrefillGate | None = None
        self.kv_events: KVEventSubscriber | None = None
        self._sync_task: asyncio.Task | None = None
        self.active = 0  # requests in flight (what a drain waits for)
        self.admission = Admission(settings.max_active_requests, settings.max_queued_requests, clock=clock)
        self.metrics.queued.set_function(lambda: self.admission.queued)  # read at scrape time
        self.draining = False
        self.openai = OpenAIApi(self)
        self.internal = InternalApi(self)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`transport`: where worker requests go (default: the network; tests may pass an
        in-process one)."""
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.settings.model)
        origins = None
        if transport is None:  # one pool per worker (serve.common.origins), its connections kept for reuse
            transport = origins = PerOriginTransport(limits=httpx.Limits(max_connections=1024,
                                                                         max_keepalive_connections=256))
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0), headers=token_headers(self.settings.cluster_token),
                                        transport=transport)
        stall = LoopStall()  # its time does not count against worker leases
        self.metrics.loop_stalled.set_function(lambda: stall.stalled_s)
        self.pool = WorkerPool(self.settings.served_model_name, self.settings.static_workers,
                               self.settings.poll_interval_s, self.settings.max_poll_failures, self.client,
                               clock=self.clock, on_removed=origins.forget if origins is not None else None,
                               stall=stall if self.clock is time.monotonic else None)
        await self.pool.start()
        self.routing = routing = Routing(self.settings, self.pool)
        cap = self.settings.max_prefills_per_worker
        self.prefill_gate = PrefillGate(cap, routing.load, lambda: routing.eligible(("prefill",))) if cap else None
        self.generation = Generation(self.pool, self.client, self.tokenizer, self.metrics,
                                     self.settings.worker_read_timeout_s, self.settings.worker_connect_timeout_s,
                                     self.routing, self.settings.prefill_timeout_s,
                                     first_token_from=self.settings.first_token_from, gate=self.prefill_gate)
        if self.settings.use_kv_events:
            self.kv_events = KVEventSubscriber(self.routing.router.index)
            self._sync_task = asyncio.create_task(self._sync_kv_events())
        log.info("frontend serving %s with %d worker(s) in rotation",
                 self.settings.served_model_name, len(self.pool.available()))

    async def _sync_kv_events(self) -> None:
        """Keep one KV-event subscription per known worker that publishes events. A worker
        briefly out of rotation keeps its subscription and index; one that left the pool
        loses both."""
        if self.pool is None or self.kv_events is None:
            return
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


def build_app(settings: FrontendSettings, frontend: Frontend | None = None,
              transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    fe = frontend or Frontend(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await fe.start(transport)
        try:
            yield
        finally:
            await fe.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.frontend = fe
    app.add_middleware(Gate, api_keys=settings.api_keys, cluster_token=settings.cluster_token,
                       exempt=settings.auth_exempt_paths, role="frontend")
    api, internal = fe.openai, fe.internal
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", internal.health, methods=["GET"])
    app.add_api_route("/metrics", internal.metrics, methods=["GET"])
    app.add_api_route("/v1/route/explain", internal.route_explain, methods=["POST"])
    app.add_api_route("/internal/register", internal.register, methods=["POST"])
    app.add_api_route("/internal/deregister", internal.deregister, methods=["POST"])
    app.add_api_route("/internal/workers", internal.list_workers, methods=["GET"])
    app.add_api_route("/live", internal.live, methods=["GET"])
    app.add_api_route("/internal/drain", internal.drain, methods=["POST"])
    app.add_api_route("/internal/requests", internal.requests, methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type_))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(bad_request(str(exc)))

    return app
