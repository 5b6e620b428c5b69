"""A worker's registration with its frontends: register, renew before the lease ends,
deregister when leaving rotation.

`WorkerRegistration.start()` begins renewing (every lease/3 seconds) with each frontend URL,
`dns+http://NAME:PORT` entries looked up again at every renewal; `stop()` ends the renewals,
bounded even if a renewal swallows its cancel, then deregisters from every frontend it
reached. Nothing here knows the engine: a real and a simulated worker register the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from serve import discovery
from serve import protocol as p

log = logging.getLogger("pdserve.worker")

# How long stopping waits for the renewal task: longer than one renewal (DNS lookup or POST,
# 5 s each), so a renewal in flight ends before the deregistration.
REGISTER_STOP_S = 11.0
JSON = {"content-type": "application/json"}


class WorkerRegistration:
    def __init__(self, frontends: list[str], lease_seconds: float, info: Callable[[], p.WorkerInfo | None],
                 http: Callable[[], httpx.AsyncClient | None]) -> None:
        self.frontends = frontends
        self.lease_seconds = lease_seconds
        self._info = info
        self._http = http
        self.stopping = False
        self.task: asyncio.Task | None = None
        self.registered: set[str] = set()
        self._unresolved: set[str] = set()

    def start(self) -> None:
        if self.frontends and self.task is None:
            self.task = asyncio.create_task(self.loop())

    async def frontend_urls(self) -> list[str]:
        urls: list[str] = []
        for entry in self.frontends:
            found = await discovery.expand(entry)
            if not found and entry not in self._unresolved:
                log.warning("frontend %s resolves to no address (yet); retrying each renewal", entry)
            (self._unresolved.add if not found else self._unresolved.discard)(entry)
            urls += [u for u in found if u not in urls]
        return urls

    async def loop(self) -> None:
        info, http = self._info(), self._http()
        if info is None or http is None:
            raise RuntimeError("registration needs the worker's info and HTTP client")
        body = p.encode(p.Registration(info=info, lease_seconds=self.lease_seconds))
        interval = max(self.lease_seconds / 3.0, 0.2)
        failing: set[str] = set()
        while not self.stopping:  # and cancelled: either one stops the renewals
            for url in await self.frontend_urls():
                if self.stopping:
                    return
                try:
                    r = await http.post(f"{url}/internal/register", content=body, headers=JSON)
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    if url not in self.registered:
                        log.info("registered with frontend %s", url)
                    self.registered.add(url)
                    failing.discard(url)
                except Exception as exc:  # keep renewing whatever happens to one frontend
                    if url not in failing:
                        log.warning("registration with frontend %s failed: %s", url, str(exc) or type(exc).__name__)
                    failing.add(url)
            await asyncio.sleep(interval)

    async def deregister(self, worker_id: str) -> None:
        http = self._http()
        if http is None:
            return
        urls = set(self.registered) | set(await self.frontend_urls())
        for url in sorted(urls):
            with contextlib.suppress(Exception):
                await http.post(f"{url}/internal/deregister", content=p.encode(p.DeregisterRequest(worker_id=worker_id)),
                                headers=JSON, timeout=2.0)
        self.registered.clear()

    async def stop(self, worker_id: str) -> None:
        """Stop renewing and deregister (idempotent): the frontends route nothing new here."""
        self.stopping = True
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            # Bounded: shutdown never waits on a renewal stuck in a frontend's connect.
            done, _ = await asyncio.wait({task}, timeout=REGISTER_STOP_S)
            if not done:
                log.warning("registration task still running %.0f s after its cancel", REGISTER_STOP_S)
            elif not task.cancelled() and task.exception() is not None:
                log.warning("registration task failed: %r", task.exception())
        await self.deregister(worker_id)
