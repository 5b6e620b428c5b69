"""`pdserve autoscale`: the controller as a process, pointed at one or more frontends.

Every `--interval` it observes the cluster (serve/autoscale/live.py), decides
(serve/autoscale/decide.py), logs one line per decision and keeps the last ones for
`GET /autoscaler` (the observation, the load it sized for, the candidates it scored with
their predictions, the reason). `GET /metrics` exports `pdserve_autoscaler_*`, among them
`pdserve_autoscaler_desired_replicas{pool}`, which an HPA can follow (the Kubernetes option
for clusters that keep their HPA). With an actuator (serve/autoscale/local.py: the
launcher's processes, `pdserve up --autoscale`; serve/autoscale/kube.py: Deployments) it
acts on each decision that changes a pool; with `--dry-run` it recommends only. An interval
in which no frontend answered decides nothing (an unseen pool is not an empty one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from serve.autoscale.actuate import Actuator
from serve.autoscale.decide import Controller, Decision
from serve.autoscale.live import LiveObserver, client, sleep_until
from serve.autoscale.model import INF

log = logging.getLogger("pdserve.autoscale")


class AutoscalerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.desired = Gauge("pdserve_autoscaler_desired_replicas", "Workers the autoscaler wants per pool",
                             ["pool"], registry=r)
        self.current = Gauge("pdserve_autoscaler_current_replicas", "Workers ready or starting per pool",
                             ["pool"], registry=r)
        self.decisions = Counter("pdserve_autoscaler_decisions", "Decisions, by whether they changed a pool",
                                 ["changed"], registry=r)
        self.predicted = Gauge("pdserve_autoscaler_predicted_seconds",
                               "The model's TTFT or ITL at the target percentile for the desired layout",
                               ["metric"], registry=r)
        self.observed = Gauge("pdserve_autoscaler_observed_seconds", "Measured TTFT or ITL at the target "
                              "percentile in the last interval", ["metric"], registry=r)
        self.rate = Gauge("pdserve_autoscaler_request_rate", "Requests/s: observed, and sized for", ["kind"],
                          registry=r)
        self.step_scale = Gauge("pdserve_autoscaler_step_scale", "Measured/modelled engine step time", registry=r)
        self.actions = Counter("pdserve_autoscaler_actions", "What the actuator did, per pool and kind (start, "
                               "drain, drained, stop, scale, mark, ready, error)", ["pool", "kind"], registry=r)
        self.skipped = Counter("pdserve_autoscaler_skipped_intervals",
                               "Intervals with no decision: no frontend answered, or the interval failed", registry=r)

    def update(self, d: Decision, percentile: float) -> None:
        for pool, n in d.desired.items():
            self.desired.labels(pool).set(n)
            self.current.labels(pool).set(d.current[pool])
        self.decisions.labels(str(d.changed).lower()).inc()
        chosen = next((c for c in d.candidates if c["layout"] == d.desired), None)
        if chosen:
            for metric in ("ttft", "itl"):
                v = chosen[f"{metric}_s"]
                self.predicted.labels(metric).set(INF if v is None else v)
        for metric in ("ttft", "itl"):
            v = d.observation.get(f"{metric}_p{percentile:g}_s")
            if v is not None:
                self.observed.labels(metric).set(v)
        self.rate.labels("observed").set(d.load["observed_rate"])
        self.rate.labels("sized_for").set(d.load["rate"])
        self.step_scale.set(d.load["step_scale"])


class Autoscaler:
    def __init__(self, controller: Controller, observer: LiveObserver, dry_run: bool,
                 actuator: Actuator | None = None, keep: int = 100) -> None:
        self.controller, self.observer, self.dry_run = controller, observer, dry_run
        self.actuator = actuator
        self.decisions: deque[Decision] = deque(maxlen=keep)
        self.metrics = AutoscalerMetrics()
        self.errors = 0
        self.skipped = 0
        if actuator is not None:
            actuator.on_action = lambda a: self.metrics.actions.labels(a.pool, a.kind).inc()

    async def once(self, http: Any) -> Decision | None:
        act = self.actuator
        starting_of = (lambda rows: act.starting(http, rows)) if act is not None else None
        obs = await self.observer.observe(http, starting_of=starting_of)
        if not obs.complete:
            self.skipped += 1
            self.metrics.skipped.inc()
            log.warning("no frontend answered: no decision this interval")
            return None
        d = self.controller.step(obs)
        self.decisions.append(d)
        self.metrics.update(d, self.controller.policy.targets.percentile)
        log.info("decision%s: %s -> %s; %s; load %s", " (dry run)" if self.dry_run else "",
                 json.dumps(d.current), json.dumps(d.desired), d.reason, json.dumps(d.load))
        if act is not None and not self.dry_run and d.changed:
            starting = {pool: obs.pools[pool].starting for pool in obs.pools}
            for a in await act.apply(d.current, d.desired, self.observer.rows, http, starting):
                d.actions.append(a.to_dict())
        return d

    async def run(self) -> None:
        pol = self.controller.policy
        async with client(self.observer.token, self.observer.timeout_s) as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time()
            try:
                while True:
                    deadline += pol.interval_s
                    await sleep_until(deadline)
                    try:
                        await self.once(http)
                    except Exception:  # one bad interval must not stop the controller
                        self.errors += 1
                        self.metrics.skipped.inc()
                        log.exception("autoscaler interval failed")
            finally:
                if self.actuator is not None:
                    await self.actuator.close()

    def explain(self) -> dict[str, Any]:
        pol = self.controller.policy
        act = self.actuator
        return {"dry_run": self.dry_run, "mode": pol.mode, "frontends": self.observer.frontends,
                "actuator": None if act is None else act.name,
                "actions": [] if act is None else [a.to_dict() for a in reversed(act.actions)],
                "targets": vars(pol.targets), "bounds": vars(pol.bounds),
                "interval_s": pol.interval_s, "cooldown_s": pol.cooldown_s, "startup_s": pol.startup_s,
                "errors": self.errors, "skipped": self.skipped, "decisions": [d.to_dict() for d in reversed(self.decisions)]}


def build_app(scaler: Autoscaler) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(scaler.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="pdserve autoscaler", lifespan=lifespan)

    async def autoscaler() -> Response:
        return JSONResponse(scaler.explain())

    async def metrics() -> Response:
        return Response(generate_latest(scaler.metrics.registry), media_type="text/plain; version=0.0.4")

    async def health() -> Response:
        return JSONResponse({"status": "ok", "decisions": len(scaler.decisions)})

    app.add_api_route("/autoscaler", autoscaler, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    return app
