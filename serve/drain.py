"""Graceful drain, shared by the worker and the frontend.

`POST /internal/drain?timeout=S&settle=S` takes the process out of rotation (its /health
turns 503, a worker deregisters), waits `settle` seconds for load balancers to notice, then
until no request is in flight or `timeout` passes. Kubernetes runs it as the preStop hook
(`pdserve drain --url ...`) before SIGTERM; uvicorn's own graceful shutdown then has
nothing left to wait for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import Request

POLL_S = 0.1
MAX_WAIT_S = 3600.0


def drain_params(request: Request, default_timeout_s: float, default_settle_s: float) -> tuple[float, float]:
    """(timeout, settle) from the query string; ValueError on a bad value."""
    def num(name: str, default: float) -> float:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        value = float(raw)
        if not 0 <= value <= MAX_WAIT_S:
            raise ValueError(f"{name} must be within 0..{MAX_WAIT_S:g} seconds")
        return value

    return num("timeout", default_timeout_s), num("settle", default_settle_s)


async def wait_idle(active: Callable[[], int], timeout_s: float, settle_s: float = 0.0) -> tuple[bool, float]:
    """Wait `settle_s`, then until `active()` is 0 or `timeout_s` (counted from the call)
    passes. Returns (idle, seconds waited)."""
    t0 = time.monotonic()
    deadline = t0 + max(timeout_s, settle_s)
    await asyncio.sleep(settle_s)
    while active() > 0 and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return active() == 0, time.monotonic() - t0
