"""The local actuator: the autoscaler starts and stops worker processes on this machine
(`pdserve up --autoscale`, real or simulated workers).

It acts through a `Spawner` (the launcher, serve/deploy/launcher.py): `start_worker(role)`
launches one worker process, which registers itself with the frontend once its engine is
up; `stop_worker(handle)` stops one (SIGTERM to its process group, SIGKILL after the grace
period). A scale-down drains each picked worker first (serve/autoscale/actuate.py), so no
request is dropped; a worker still starting is stopped without a drain (it serves nothing).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import httpx

from serve import protocol as p
from serve.auth import token_headers
from serve.autoscale.actuate import Action, ActionLog, Background, drain, now, pick_to_retire



class Spawner(Protocol):
    def start_worker(self, role: str) -> tuple[str, Any]:
        """Launch one worker of `role`: (its URL, a handle for the other calls)."""
        ...

    def alive(self, handle: Any) -> bool: ...

    def stop_worker(self, handle: Any) -> None:
        """Stop it (blocking, bounded by the spawner's grace period)."""
        ...


class LocalActuator(ActionLog):
    name = "local"

    def __init__(self, spawner: Spawner, workers: dict[str, tuple[str, Any]] | None = None,
                 drain_timeout_s: float = 60.0, start_timeout_s: float = 900.0, token: str | None = None,
                 keep: int = 200) -> None:
        self.spawner = spawner
        self.token = token
        self.workers: dict[str, tuple[str, Any]] = dict(workers or {})  # url -> (role, handle): serving
        self.pending: dict[str, tuple[str, Any, float]] = {}  # url -> (role, handle, started at): starting
        self.retiring: set[str] = set()
        self.drain_timeout_s, self.start_timeout_s = drain_timeout_s, start_timeout_s
        self.background = Background()
        ActionLog.__init__(self, keep)
        self.closed = False

    async def starting(self, http: httpx.AsyncClient, rows: list[p.WorkerRow] | None = None) -> dict[str, int]:
        """Workers launched and not serving yet, per pool. With `rows` (the frontend's view), a
        worker serves once it is in the frontend's rotation (its /health turns 200 a moment
        before it has registered: counted as starting until then, not as missing); without
        them, once its /health answers 200."""
        in_rotation = None if rows is None else {r.url for r in rows if r.in_rotation}
        out: dict[str, int] = {}
        for url, (role, handle, t0) in list(self.pending.items()):
            if not self.spawner.alive(handle):
                del self.pending[url]
                self._record(Action(now(), role, "error", url, "exited during start-up"))
                continue
            if in_rotation is not None:
                ready = url in in_rotation
            else:
                try:
                    ready = (await http.get(f"{url}/health", timeout=2.0)).status_code == 200
                except httpx.HTTPError:
                    ready = False
            if ready:
                del self.pending[url]
                self.workers[url] = (role, handle)
                self._record(Action(now(), role, "ready", url, f"serving after {now() - t0:.1f} s"))
            elif now() - t0 > self.start_timeout_s:
                del self.pending[url]
                self._record(Action(now(), role, "error", url, f"not ready after {self.start_timeout_s:.0f} s; "
                                                               "stopping it"))
                await asyncio.to_thread(self.spawner.stop_worker, handle)
            else:
                out[role] = out.get(role, 0) + 1
        for url, (_, handle) in list(self.workers.items()):
            if url not in self.retiring and not self.spawner.alive(handle):
                del self.workers[url]  # it died; the pool counts one less and the controller sees it
        return out

    async def apply(self, current: dict[str, int], desired: dict[str, int], rows: list[p.WorkerRow],
                    http: httpx.AsyncClient, starting: dict[str, int] | None = None) -> list[Action]:
        if self.closed:
            return []
        acts: list[Action] = []
        for pool, want in desired.items():
            diff = want - current.get(pool, 0)
            for _ in range(max(0, diff)):
                url, handle = await asyncio.to_thread(self.spawner.start_worker, pool)
                self.pending[url] = (pool, handle, now())
                acts.append(self._record(Action(now(), pool, "start", url)))
            if diff < 0:
                acts += await self._retire(pool, -diff, rows)
        return acts

    async def _retire(self, pool: str, n: int, rows: list[p.WorkerRow]) -> list[Action]:
        acts: list[Action] = []
        # Still starting: nothing to drain, stopped at once (the newest first).
        for url in [u for u, (role, _, _) in reversed(self.pending.items()) if role == pool][:n]:
            _, handle, _ = self.pending.pop(url)
            await asyncio.to_thread(self.spawner.stop_worker, handle)
            acts.append(self._record(Action(now(), pool, "stop", url, "was still starting")))
            n -= 1
        mine = {u for u, (role, _) in self.workers.items() if role == pool and u not in self.retiring}
        for url in pick_to_retire(rows, pool, n, mine):
            self.retiring.add(url)
            acts.append(self._record(Action(now(), pool, "drain", url, "leaving rotation")))
            self.background.spawn(self._drain_and_stop(pool, url), f"retire {url}")
        return acts

    async def _drain_and_stop(self, pool: str, url: str) -> None:
        try:
            async with httpx.AsyncClient(headers=token_headers(self.token)) as http:
                ok, what = await drain(http, url, self.drain_timeout_s)
            self._record(Action(now(), pool, "drained" if ok else "error", url, what))
            _, handle = self.workers.pop(url)
            await asyncio.to_thread(self.spawner.stop_worker, handle)
            self._record(Action(now(), pool, "stop", url, "stopped"))
        finally:
            self.retiring.discard(url)

    async def settle(self, timeout_s: float) -> None:
        """Wait until the retirements under way have finished (each is bounded by its drain)."""
        await self.background.wait(timeout_s)

    async def close(self) -> None:
        """Start nothing more. Retirements under way are cancelled: this actuator closes when
        the whole stack stops, and the launcher then stops every worker process itself."""
        self.closed = True
        await self.background.wait(0.0)
