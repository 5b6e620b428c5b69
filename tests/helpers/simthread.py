"""A `SimCluster` (the real frontend and simulated workers) on its own event loop in a
background thread, so plain synchronous tests can talk to it with httpx as they talk to
real processes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from serve.sim.cluster import SimCluster


class ThreadedSimCluster:
    def __init__(self, model_dir: str, roles: list[str], **kw: Any) -> None:
        self._cluster = SimCluster(model_dir, roles, **kw)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-cluster", daemon=True)

    def __enter__(self) -> ThreadedSimCluster:
        self._thread.start()
        try:
            self.call(self._cluster.__aenter__())
        except BaseException:
            self._halt()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.call(self._cluster.__aexit__(None, None, None))
        finally:
            self._halt()

    def _halt(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def call(self, coro: Coroutine, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def cluster(self) -> SimCluster:
        return self._cluster

    @property
    def url(self) -> str:
        return self._cluster.url

    def urls(self, role: str) -> list[str]:
        return self._cluster.urls(role)

    def kill(self, url: str) -> None:
        self.call(self._cluster.kill(url))

    def add_worker(self, role: str, **overrides: Any) -> str:
        return self.call(self._cluster.add_worker(role, **overrides))

    def in_rotation(self, role: str | None = None) -> list[str]:
        return self.call(_value(self._cluster.in_rotation(role)))


async def _value(v: Any) -> Any:
    return v
