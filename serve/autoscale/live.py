"""The autoscaler's eyes on a running cluster: one `Observation` per interval, over HTTP.

From each frontend: `GET /internal/requests?since=N` (every finished request exactly: its
arrival, ISL, OSL, TTFT and duration; the arrivals counter, what is queued) and, from the
first one that answers, `GET /internal/workers` (the pools: workers in rotation, or out of it
while draining). From each worker in rotation: `GET /load` (requests waiting for a slot) and
`GET /steps?since=N` (its engine steps, timed; against the step model they give the
measured/modelled ratio the model is scaled by, from workers past `warmup_s` only).
Latency samples count only for requests that arrived within two intervals (a backlog that
drains late is not a pool too small). Every call has a timeout; a frontend or worker that
does not answer is left out of that interval and logged.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from serve import discovery
from serve import protocol as p
from serve.auth import token_headers
from serve.autoscale.observe import Observation, Pool
from serve.sim.timing import StepModel

log = logging.getLogger("pdserve.autoscale")
_REQUESTS, _WORKERS = p.decoder(p.RequestsReply), p.decoder(p.WorkersReply)
_LOAD, _STEPS = p.decoder(p.WorkerLoad), p.decoder(p.StepsReply)


@dataclass
class LiveObserver:
    frontends: list[str]
    pools: tuple[str, ...]
    interval_s: float
    step_model: StepModel | None = None
    token: str | None = None
    warmup_s: float = 60.0
    timeout_s: float = 5.0
    since: dict[str, int] = field(default_factory=dict)
    arrivals: dict[str, int] = field(default_factory=dict)
    step_since: dict[str, int] = field(default_factory=dict)
    first_seen: dict[str, float] = field(default_factory=dict)
    rows: list[p.WorkerRow] = field(default_factory=list)  # the workers as the last observation saw them

    async def observe(self, client: httpx.AsyncClient, starting: dict[str, int] | None = None,
                      starting_of: Callable[[list[p.WorkerRow]], Awaitable[dict[str, int]]] | None = None
                      ) -> Observation:
        """One interval's observation. `starting`: workers launched and not serving yet, per
        pool, or `starting_of(rows)` to ask for them once the workers are known. When no
        frontend answered, `obs.complete` is False: nothing to decide on."""
        now = time.time()
        obs = Observation(time.monotonic(), self.interval_s, 0, pools={q: Pool() for q in self.pools})
        recent = now - 2 * self.interval_s
        rows: list[p.WorkerRow] | None = None
        for fe in await self.frontend_urls():
            try:
                r = (await client.get(f"{fe}/internal/requests", params={"since": self.since.get(fe, 0)})).raise_for_status()
                reply = _REQUESTS(r.content)
                if rows is None:
                    w = (await client.get(f"{fe}/internal/workers")).raise_for_status()
                    rows = _WORKERS(w.content).workers
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("frontend %s: no observation this interval (%s)", fe, exc)
                continue
            first = fe not in self.arrivals
            obs.arrivals += 0 if first else max(0, reply.arrivals - self.arrivals[fe])
            self.arrivals[fe], self.since[fe] = reply.arrivals, reply.next
            obs.queued += reply.queued
            if "prefill" in obs.pools:  # held in the frontend for a prefill worker: that pool's backlog
                obs.pools["prefill"].waiting += reply.prefill_held
            for s in reply.samples:
                if first:
                    continue  # before the autoscaler was looking: history, not this interval
                obs.isl.append(s.isl)
                obs.osl.append(s.osl)
                if not s.ok:
                    obs.failed += 1
                elif s.arrival >= recent and s.ttft_s is not None:
                    obs.ttft_s.append(s.ttft_s)
                    if s.osl > 1:
                        obs.itl_s.append((s.duration_s - s.ttft_s) / (s.osl - 1))
        obs.complete = rows is not None
        self.rows = list(rows or [])
        if starting_of is not None and obs.complete:
            starting = await starting_of(self.rows)
        for role, n in (starting or {}).items():
            if role in obs.pools:
                obs.pools[role].starting = n
        ratios: list[float] = []
        for row in rows or []:
            if row.role not in obs.pools:
                continue
            pool = obs.pools[row.role]
            if not row.in_rotation:
                pool.draining += 1
                continue
            pool.ready += 1
            self.first_seen.setdefault(row.url, now)
            waiting, scale = await self._worker(client, row.url, now - self.first_seen[row.url] >= self.warmup_s)
            pool.waiting += waiting
            ratios += scale
        obs.step_scale = statistics.median(ratios) if len(ratios) >= 5 else None
        return obs

    async def frontend_urls(self) -> list[str]:
        """Every frontend now: `http://HOST:PORT` as given, `dns+http://NAME:PORT` expanded to
        each address NAME resolves to (on Kubernetes, the frontends' headless Service)."""
        urls: list[str] = []
        for entry in self.frontends:
            found = await discovery.expand(entry)
            if not found:
                log.warning("frontend %s resolves to no address this interval", entry)
            urls += [u for u in found if u not in urls]
        return urls

    async def _worker(self, client: httpx.AsyncClient, url: str, warm: bool) -> tuple[int, list[float]]:
        waiting, ratios = 0, []
        try:
            load = _LOAD((await client.get(f"{url}/load")).raise_for_status().content)
            waiting = load.waiting_requests
            if self.step_model is not None:
                r = await client.get(f"{url}/steps", params={"since": self.step_since.get(url, 0)})
                steps = _STEPS(r.raise_for_status().content)
                self.step_since[url] = steps.next_seq
                if warm and not steps.simulated:
                    for s in steps.steps:
                        model = self.step_model.step_seconds(s.d, [(c, n) for c, n in s.p])
                        if model > 0 and s.s > 0:
                            ratios.append(s.s / model)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("worker %s: no load or steps this interval (%s)", url, exc)
        return waiting, ratios


def client(token: str | None, timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), headers=token_headers(token))


async def sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
