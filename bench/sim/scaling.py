"""The SLA autoscaler driving the offline cluster: `serve.autoscale`'s controller, unchanged,
acting on simulated workers on the virtual clock.

Each `interval_s` the scaler builds the interval's `Observation` from what the frontend saw
(arrivals; the TTFT and mean inter-token latency of requests that finished in it and arrived
within two intervals, so a backlog drained after a scale-up does not read as a pool too
small; failures; the queue) and the pools' workers by state, asks the controller, and acts:
- **start**: a new worker of the pool registers `startup_s` later (it costs worker-time
  from the moment it is started);
- **stop**: through drain, never a kill: the worker leaves rotation (its `WorkerLoad` says
  draining, as a real worker's does), finishes its streams and, for a prefill worker, keeps
  its held blocks until their decode workers have read them; then it deregisters. The
  youngest ready workers go first.
The run keeps every decision and the provisioned workers over time (`timeline`), for
worker-hours and the explanation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from serve.autoscale.decide import Controller, Decision
from serve.autoscale.observe import Observation, Pool

from bench.sim.cluster import OfflineCluster
from bench.sim.flow import Flow, SimWorker
from bench.sim.loop import Loop
from serve.sim.timing import StepModel


@dataclass
class SimScaler:
    controller: Controller
    step_model: StepModel
    startup_s: float = 60.0
    dry_run: bool = False
    decisions: list[Decision] = field(default_factory=list)
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (t, provisioned per pool)

    def attach(self, loop: Loop, cluster: OfflineCluster, flows: list[Flow], total: int) -> None:
        self.loop, self.cluster, self.flows, self.total = loop, cluster, flows, total
        self.starting: dict[str, int] = {p: 0 for p in self.controller.policy.pools}
        self.order = {w.url: i for i, w in enumerate(cluster.workers.values())}
        self.names = itertools.count(len(cluster.workers))
        self.arrived: list[Flow] = []
        self.seen = 0
        self.reaping = False
        cluster.on_submit = self._arrival
        self._mark()
        loop.after(self.controller.policy.interval_s, self._tick)

    def _arrival(self, flow: Flow) -> None:
        self.arrived.append(flow)

    # -- state ---------------------------------------------------------------------------
    def pools(self) -> dict[str, Pool]:
        out = {p: Pool(starting=self.starting[p]) for p in self.controller.policy.pools}
        for w in self.cluster.workers.values():
            if w.alive and w.role in out:
                if w.draining:
                    out[w.role].draining += 1
                else:
                    out[w.role].ready += 1
                out[w.role].waiting += len(w.engine.waiting)
        if self.cluster.gate is not None and "prefill" in out:
            out["prefill"].waiting += self.cluster.gate.held  # the frontend's prefill gate: as live (prefill_held)
        return out

    def provisioned(self) -> dict[str, int]:
        """Workers that cost: starting, ready and draining."""
        return {p: v.ready + v.starting + v.draining for p, v in self.pools().items()}

    def _mark(self) -> None:
        self.timeline.append((self.loop.now, self.provisioned()))

    # -- each interval -------------------------------------------------------------------
    def _tick(self) -> None:
        pol = self.controller.policy
        now = self.loop.now
        done = self.flows[self.seen:]
        self.seen = len(self.flows)
        arrived, self.arrived = self.arrived, []
        ttft, itl, failed = [], [], 0
        recent = now - 2 * pol.interval_s  # latencies of recent arrivals: not a drained backlog's
        for f in done:
            if f.error is not None:
                failed += 1
                continue
            if f.arrival < recent:
                continue
            if f.times:
                ttft.append(f.times[0] - f.arrival)
            if len(f.times) > 1:
                itl.append((f.times[-1] - f.times[0]) / (len(f.times) - 1))
        obs = Observation(now, pol.interval_s, len(arrived), [len(f.prompt) or f.isl for f in arrived],
                          [f.osl for f in arrived], ttft, itl, failed, len(self.cluster.queue), self.pools())
        d = self.controller.step(obs)
        self.decisions.append(d)
        if d.changed and not self.dry_run:
            for p in pol.pools:
                delta = d.desired[p] - d.current[p]
                for _ in range(max(0, delta)):
                    self._start(p)
                if delta < 0:
                    self._stop(p, -delta)
        self._reap()
        self._mark()
        if len(self.flows) < self.total:
            self.loop.after(pol.interval_s, self._tick)

    def _start(self, role: str) -> None:
        self.starting[role] += 1
        url = f"http://sim-{role}-{next(self.names)}:8100"

        def ready() -> None:
            self.starting[role] -= 1
            w = self.cluster.add_worker(url, role, self.step_model)
            self.order[w.url] = len(self.order)
            self._mark()
        self.loop.after(self.startup_s, ready)

    def _stop(self, role: str, n: int) -> None:
        """Drain n workers of `role`: starting ones are not cancelled (their start-up is
        paid); the youngest ready ones leave rotation."""
        ready = [w for w in self.cluster.workers.values() if w.role == role and w.alive and not w.draining]
        ready.sort(key=lambda w: self.order.get(w.url, 0), reverse=True)
        for w in ready[:n]:
            self.cluster.drain(w.url)
        self._reap()

    def _busy(self, w: SimWorker) -> bool:
        return bool(w.engine.requests) or any(w is f.prefill or w is f.decode for f in self.cluster.flows.values())

    def _reap(self) -> None:
        """Drained workers with nothing left in flight deregister; while some still drain,
        look again each second."""
        gone = False
        for w in [w for w in self.cluster.workers.values() if w.draining and w.alive]:
            if not self._busy(w):
                self.cluster.retire(w.url)
                gone = True
        if gone:
            self._mark()
        if not self.reaping and any(w.draining and w.alive for w in self.cluster.workers.values()):
            self.reaping = True
            self.loop.after(1.0, self._reap_again)

    def _reap_again(self) -> None:
        self.reaping = False
        self._reap()

    def summary(self, end_s: float) -> dict[str, Any]:
        hours = 0.0
        for (t0, c0), (t1, _) in zip(self.timeline, self.timeline[1:] + [(end_s, {})]):
            hours += sum(c0.values()) * max(0.0, t1 - t0) / 3600
        changes = [d.to_dict() for d in self.decisions if d.changed]
        return {"worker_hours": round(hours, 3), "decisions": len(self.decisions), "changes": len(changes),
                "timeline": [{"t": round(t, 1), **c} for t, c in self.timeline]}
