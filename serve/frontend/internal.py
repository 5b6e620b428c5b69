"""The frontend's operational endpoints: probes, metrics, drain, discovery and the routing
dry run.

    GET /health (readiness: 200 with a worker in rotation, 503 without or while draining)
    GET /live   GET /metrics   POST /v1/route/explain
    POST /internal/register (Registration)   POST /internal/deregister (DeregisterRequest)
    GET /internal/workers (WorkersReply)     POST /internal/drain?timeout=S&settle=S (DrainReply)
    GET /internal/requests?since=N (RequestsReply: finished requests, exactly, for an autoscaler)

Bodies are the typed structs of `serve.protocol`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from serve import protocol as p
from serve.drain import drain_params, wait_idle
from serve.errors import NoWorkerAvailable
from serve.frontend import openai_protocol as oai
from serve.frontend.errors import APIError, bad_request, error_response
from serve.frontend.openai_api import read_json, request_model, unavailable

if TYPE_CHECKING:
    from serve.frontend.app import Frontend

log = logging.getLogger("pdserve.frontend")
JSON = "application/json"
ROLES = ("agg", "prefill", "decode")


def reply(msg: msgspec.Struct, status: int = 200) -> Response:
    return Response(p.encode(msg), status_code=status, media_type=JSON)


class InternalApi:
    def __init__(self, fe: Frontend) -> None:
        self.fe = fe
        self._decode_registration = p.decoder(p.Registration)
        self._decode_deregister = p.decoder(p.DeregisterRequest)

    async def health(self) -> Response:
        n = len(self.fe.pool.available())
        if self.fe.draining:
            return JSONResponse({"status": "draining", "workers": n}, status_code=503)
        return JSONResponse({"status": "ok" if n else "no workers", "workers": n}, status_code=200 if n else 503)

    async def live(self) -> Response:
        return JSONResponse({"status": "alive"})

    async def drain(self, request: Request) -> Response:
        fe = self.fe
        try:
            timeout, settle = drain_params(request, fe.settings.graceful_timeout_s, fe.settings.drain_settle_s)
        except ValueError as exc:
            return error_response(bad_request(str(exc)))
        fe.draining = True
        log.info("drain: out of readiness, %d request(s) in flight (settle %.0fs, timeout %.0fs)",
                 fe.active, settle, timeout)
        idle, waited = await wait_idle(lambda: fe.active, timeout, settle)
        log.info("drain: %s after %.1fs", "idle" if idle else f"{fe.active} request(s) still in flight", waited)
        return reply(p.DrainReply(drained=idle, active_requests=fe.active, waited_s=round(waited, 3)))

    async def requests(self, request: Request) -> Response:
        """`GET /internal/requests?since=N&limit=M`: finished requests after sample N (exact, for
        an autoscaler), with the arrivals counter and what is in flight and queued now."""
        try:
            since = int(request.query_params.get("since", "0"))
            limit = int(request.query_params.get("limit", "20000"))
            if since < 0 or limit < 1:
                raise ValueError
        except ValueError:
            return error_response(bad_request("since must be an integer >= 0 and limit >= 1"))
        fe = self.fe
        samples, nxt, dropped = fe.requests.since(since, limit)
        return reply(p.RequestsReply(samples=samples, next=nxt, dropped=dropped, arrivals=fe.requests.arrivals,
                                     in_flight=fe.active, queued=fe.admission.queued if fe.admission else 0,
                                     prefill_held=fe.prefill_gate.held if fe.prefill_gate is not None else 0))

    async def metrics(self) -> Response:
        fe = self.fe
        m = fe.metrics
        available = fe.pool.available()
        m.prefill_held.set(fe.prefill_gate.held if fe.prefill_gate is not None else 0)
        for role in ROLES:
            m.workers.labels(role).set(sum(1 for e in available if e.info is not None and e.info.role == role))
        for e in available:
            if e.info is not None and e.load is not None:
                m.worker_kv_usage.labels(e.url, e.info.role).set(e.load.kv_usage)
                m.worker_active_blocks.labels(e.url, e.info.role).set(e.load.active_blocks)
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def route_explain(self, request: Request) -> Response:
        """Dry run of the routing decision for a chat or completion body: nothing is sent."""
        fe = self.fe
        try:
            body = await read_json(request, fe.settings.max_body_bytes)
            kind, model = request_model(body)
            req = oai.parse(model, body)
            prompt_ids = fe.openai.prompt_ids(req, kind)
            explained = fe.routing.explain(prompt_ids)
            if explained.prefill is not None:
                explained = msgspec.structs.replace(
                    explained, first_token_from=fe.generation.first_token_source(getattr(req, "seed", None)))
            return reply(explained)
        except APIError as err:
            return error_response(err)
        except NoWorkerAvailable as exc:
            return error_response(unavailable(exc, fe.settings.retry_after_s))

    async def register(self, request: Request) -> Response:
        try:
            reg = self._decode_registration(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return reply(p.RegistrationReply(accepted=False, message=f"invalid registration: {exc}"), 400)
        answer = self.fe.pool.register(reg)
        if not answer.accepted:
            log.warning("refused registration of %s: %s", reg.info.url, answer.message)
        return reply(answer, 200 if answer.accepted else 409)

    async def deregister(self, request: Request) -> Response:
        try:
            msg = self._decode_deregister(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return reply(p.ErrorReply(f"invalid deregistration: {exc}"), 400)
        if not msg.id:
            return reply(p.ErrorReply("invalid deregistration: worker_id is empty"), 400)
        return reply(p.DeregisterReply(self.fe.pool.deregister(msg.id)))

    async def list_workers(self) -> Response:
        fe = self.fe
        rows = [p.WorkerRow(url=e.url, worker_id=e.info.worker_id if e.info else None,
                            role=e.info.role if e.info else None, in_rotation=e.in_rotation,
                            inflight=fe.routing.load.requests(e.url), failures=e.failures, static=e.static,
                            engine=e.info.engine if e.info else None)
                for e in fe.pool.workers.values()]
        return reply(p.WorkersReply(rows))
