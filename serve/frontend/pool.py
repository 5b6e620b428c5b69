"""The frontend's view of its workers: who they are, whether they are healthy, their load.

Workers come from `--worker URL` (static; their `/info` is fetched) or register
themselves (`POST /internal/register`, renewed before the lease ends). A poller reads
every worker's `/load`; a worker that fails `max_poll_failures` polls in a row, or whose
lease ran out, leaves rotation, and comes back as soon as a poll succeeds again. Leases are
checked on `lease_clock`: the pool's clock less the time the frontend's event loop stalled
(serve/frontend/loopstall.py), so a starved frontend does not expire every lease at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import httpx

from router.filters import WorkerView
from serve import protocol as p
from serve.frontend.loopstall import LoopStall

log = logging.getLogger("pdserve.frontend.pool")


@dataclass
class WorkerEntry:
    url: str
    info: p.WorkerInfo | None = None
    static: bool = False
    lease_expiry: float = float("inf")
    healthy: bool = False
    failures: int = 0
    load: p.WorkerLoad | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    # Bumped by every change to any entry: the routing's caches of views and candidates are
    # valid while it stays (and no lease has run out since they were built).
    version: ClassVar[int] = 0

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        WorkerEntry.version += 1

    @property
    def leased(self) -> bool:
        return self.healthy and self.info is not None and self.clock() < self.lease_expiry

    @property
    def draining(self) -> bool:
        return self.load is not None and self.load.draining

    @property
    def in_rotation(self) -> bool:
        return self.leased and not self.draining

    def view(self) -> WorkerView:
        """What the router's filter stage knows of this worker."""
        info = self.info
        return WorkerView(self.url, info.role if info else "", in_rotation=self.leased, draining=self.draining,
                          block_size=info.block_size if info else 0,
                          kv_cache_dtype=info.kv_cache_dtype if info else "auto")


class WorkerPool:
    # Polls of /load a second at most, all workers together: past `poll_budget_per_s` workers
    # each is polled less often than every poll interval (1,000 workers: every 4 s), rather
    # than the frontend spending its CPU on polls. Polls are spread over the cycle in small
    # batches (one every BATCH_S): a burst of a thousand GETs at once made polls time out on
    # a loaded frontend, and three timed-out polls take a healthy worker out of rotation.
    BATCH_S = 0.05
    # A failed poll during which this frontend's loop stalled this long is not the worker's failure.
    STALLED_POLL_S = 1.0

    def __init__(self, served_model_name: str, static_urls: list[str], poll_interval_s: float,
                 max_failures: int, client: httpx.AsyncClient, clock: Callable[[], float] = time.monotonic,
                 poll_budget_per_s: float = 250.0, on_removed: Callable[[str], None] | None = None,
                 stall: LoopStall | None = None) -> None:
        """`stall`: this loop's stall meter, started and stopped with the poller; its time does
        not count against leases (None: leases run on `clock` alone, as in a simulation)."""
        self.served_model_name = served_model_name
        self.on_removed = on_removed  # told the URL of each worker that leaves the pool
        self.poll_interval_s = poll_interval_s
        self.poll_budget_per_s = poll_budget_per_s
        self.max_failures = max_failures
        self.client = client
        self.clock = clock
        self.stall = stall
        self.workers: dict[str, WorkerEntry] = {
            u.rstrip("/"): WorkerEntry(url=u.rstrip("/"), static=True, clock=self.lease_clock) for u in static_urls
        }
        self._poller: asyncio.Task | None = None
        self._decode_info = p.decoder(p.WorkerInfo)
        self._decode_load = p.decoder(p.WorkerLoad)

    def lease_clock(self) -> float:
        """The time leases run on: `clock` less the frontend's stalls."""
        return self.clock() - (self.stall.now_s() if self.stall is not None else 0.0)

    async def start(self) -> None:
        if self.stall is not None:
            self.stall.start()
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.stall is not None:
            await self.stall.stop()

    # -- registration -----------------------------------------------------------------
    def register(self, reg: p.Registration) -> p.RegistrationReply:
        info = reg.info
        if info.protocol_version != p.PROTOCOL_VERSION:
            return p.RegistrationReply(accepted=False, message=(
                f"worker protocol version {info.protocol_version} != frontend's {p.PROTOCOL_VERSION}"))
        if info.served_model_name != self.served_model_name:
            return p.RegistrationReply(accepted=False, message=(
                f"worker serves {info.served_model_name!r}, this frontend serves {self.served_model_name!r}"))
        url = info.url.rstrip("/")
        entry = self.workers.get(url)
        if entry is None:
            entry = self.workers[url] = WorkerEntry(url=url, clock=self.lease_clock)
            log.info("worker %s (%s) registered at %s", info.worker_id, info.role, url)
        elif entry.info is not None and entry.info.worker_id != info.worker_id:
            log.info("worker at %s restarted as %s", url, info.worker_id)
            entry.failures = 0
        entry.info = info
        if not entry.static:
            entry.lease_expiry = self.lease_clock() + reg.lease_seconds
        if not entry.healthy and entry.failures == 0:
            entry.healthy = True
        return p.RegistrationReply(accepted=True)

    def deregister(self, worker_id: str) -> bool:
        for url, entry in list(self.workers.items()):
            if entry.info is not None and entry.info.worker_id == worker_id:
                if entry.static:
                    entry.healthy = False
                else:
                    self._remove(url)
                log.info("worker %s deregistered", worker_id)
                return True
        return False

    def _remove(self, url: str) -> None:
        del self.workers[url]
        WorkerEntry.version += 1
        if self.on_removed is not None:
            self.on_removed(url)

    # -- health and load --------------------------------------------------------------
    def cycle_s(self) -> float:
        """Seconds between two polls of one worker."""
        return max(self.poll_interval_s, len(self.workers) / self.poll_budget_per_s)

    async def _poll_loop(self) -> None:
        await asyncio.sleep(self.poll_interval_s)
        while True:
            t0 = time.monotonic()
            cycle = self.cycle_s()
            await self.poll_once(spread_s=cycle)
            await asyncio.sleep(max(self.BATCH_S, cycle - (time.monotonic() - t0)))

    async def poll_once(self, spread_s: float = 0.0) -> None:
        """Poll every worker once: all at once, or in batches spread over `spread_s`."""
        now = self.lease_clock()
        grace = 3 * self.cycle_s() + 30
        for url, entry in list(self.workers.items()):
            if not entry.static and now > entry.lease_expiry + grace:
                log.info("worker at %s dropped: lease expired", url)
                self._remove(url)
        entries = list(self.workers.values())
        batches = max(1, min(len(entries), int(spread_s / self.BATCH_S)))
        size = -(-len(entries) // batches) if entries else 1
        t0 = time.monotonic()
        for i, start in enumerate(range(0, len(entries), size)):
            await asyncio.gather(*(self._poll(e) for e in entries[start:start + size]))
            if batches > 1:
                await asyncio.sleep(max(0.0, t0 + (i + 1) * spread_s / batches - time.monotonic()))

    async def _poll(self, entry: WorkerEntry) -> None:
        stalled0 = self.stall.now_s() if self.stall is not None else 0.0
        try:
            if entry.info is None:
                r = await self.client.get(f"{entry.url}/info", timeout=2.0)
                r.raise_for_status()
                info = self._decode_info(r.content)
                if info.served_model_name != self.served_model_name:
                    raise ValueError(f"serves {info.served_model_name!r}, not {self.served_model_name!r}")
                entry.info = info
            r = await self.client.get(f"{entry.url}/load", timeout=2.0)
            r.raise_for_status()
            entry.load = self._decode_load(r.content)
            if entry.info is not None and entry.load.worker_id != entry.info.worker_id:
                entry.info = None  # restarted behind the same URL: fetch its identity again
                raise ValueError("worker restarted")
        except Exception as exc:  # any failure counts; the worker comes back on success
            stalled = self.stall.now_s() - stalled0 if self.stall is not None else 0.0
            if stalled >= self.STALLED_POLL_S:
                # this frontend stood still during the poll (its 2-s timeout may have run out
                # while the reply waited unread): the worker is not to blame
                log.debug("poll of %s failed during a %.1f-s stall of this frontend; not counted", entry.url, stalled)
                return
            entry.failures += 1
            if entry.healthy and entry.failures >= self.max_failures:
                entry.healthy = False
                log.warning("worker at %s left rotation after %d failed polls: %s", entry.url, entry.failures, exc)
            return
        if not entry.healthy:
            log.info("worker at %s in rotation", entry.url)
        entry.healthy = True
        entry.failures = 0

    def report_failure(self, url: str) -> None:
        """A request to this worker failed at the transport level: count it like a failed poll."""
        entry = self.workers.get(url)
        if entry is None:
            return
        entry.failures += 1
        if entry.failures >= self.max_failures and entry.healthy:
            entry.healthy = False
            log.warning("worker at %s left rotation after %d failures", url, entry.failures)

    # -- choosing -----------------------------------------------------------------------
    def available(self, roles: tuple[str, ...] | None = None) -> list[WorkerEntry]:
        return [e for e in self.workers.values()
                if e.in_rotation and (roles is None or (e.info is not None and e.info.role in roles))]

    def max_model_len(self) -> int | None:
        lens = [e.info.max_model_len for e in self.available() if e.info is not None]
        return min(lens) if lens else None

    def seeds_supported(self) -> bool:
        """False if any worker in rotation cannot serve a seeded request."""
        return all(e.info.seeds for e in self.available() if e.info is not None)
