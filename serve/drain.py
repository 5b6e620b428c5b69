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
import argparse
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


# -- the client: `pdserve drain` ----------------------------------------------------------

def add_arguments(d: argparse.ArgumentParser) -> None:
    import os

    d.add_argument("--url", default="http://127.0.0.1:8000", help="the process to drain (default: %(default)s)")
    d.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for in-flight requests (default: the process's --graceful-timeout)")
    d.add_argument("--settle", type=float, default=None,
                   help="seconds to keep serving first, for load balancers to notice (default: the process's)")
    d.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
                   help="the process's cluster token, if it has one (env PDSERVE_CLUSTER_TOKEN)")


def run_client(args: argparse.Namespace) -> int:
    """POST /internal/drain and report; 0 drained, 1 requests still in flight."""
    import httpx
    import msgspec

    from serve.auth import token_headers
    from serve.errors import PdserveError
    from serve.protocol import DrainReply

    params = {k: v for k, v in (("timeout", args.timeout), ("settle", args.settle)) if v is not None}
    for k, v in params.items():
        if v < 0:
            raise PdserveError(f"--{k} must be >= 0")
    wait = sum(params.values()) if params else 3600.0
    try:
        r = httpx.post(f"{args.url.rstrip('/')}/internal/drain", params=params, timeout=wait + 10.0,
                       headers=token_headers(args.cluster_token))
    except httpx.HTTPError as exc:
        raise PdserveError(f"{args.url}: {exc}") from exc
    if r.status_code != 200:
        raise PdserveError(f"{args.url}: HTTP {r.status_code}: {r.text[:200]}")
    try:
        body = msgspec.json.decode(r.content, type=DrainReply)
    except msgspec.DecodeError as exc:
        raise PdserveError(f"{args.url}: not a drain reply: {exc}") from None
    print(f"pdserve drain: {args.url}: " + ("drained" if body.drained else
          f"{body.active_requests} request(s) still in flight") + f" after {body.waited_s} s")
    return 0 if body.drained else 1
