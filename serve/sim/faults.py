"""Faults on demand for a live simulated worker: `POST /sim/fault` (behind the worker's
cluster token, like every worker endpoint but the probes).

    {"fault": "slow_step", "factor": 3}         every engine step takes 3x its modelled time
    {"fault": "stall_transfer", "seconds": 5}   a decode worker waits 5 s before each KV READ
    {"fault": "kill"}                           the engine dies: its requests end in errors,
                                                /live and /health answer 503, its side channel
                                                goes silent (the process lives on)
    {"fault": "clear"}                          slow_step and stall_transfer back to none

The reply is the worker's fault state, `{"engine": "sim", "slow_step": F, "stall_transfer_s": S,
"killed": bool}`; a bad body is a 400 with one line. Only simulated workers have this route.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from serve.sim.backend import SimBackend

log = logging.getLogger("pdserve.sim")
KINDS = ("slow_step", "stall_transfer", "kill", "clear")


class FaultError(ValueError):
    """A fault request that cannot be applied (one line)."""


def _number(body: dict[str, Any], key: str, low: float) -> float:
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
        raise FaultError(f"'{key}' must be a number >= {low:g}, got {v!r}")
    return float(v)


async def apply(backend: SimBackend, body: Any) -> dict[str, Any]:
    """Apply one fault; the worker's fault state after it."""
    if not isinstance(body, dict) or body.get("fault") not in KINDS:
        raise FaultError(f"expected {{\"fault\": one of {', '.join(KINDS)}}}")
    engine = backend.engine
    if engine is None:
        raise FaultError("the simulated engine has not started")
    kind = body["fault"]
    if kind == "slow_step":
        engine.slowdown = _number(body, "factor", 1.0)
    elif kind == "stall_transfer":
        if backend.reader is None:
            raise FaultError(f"stall_transfer applies to decode workers (their KV READs), not a {backend.role.role} "
                             "worker")
        backend.reader.fault_pause_s = _number(body, "seconds", 0.0)
    elif kind == "kill":
        await backend.kill()
    else:
        engine.slowdown = 1.0
        if backend.reader is not None:
            backend.reader.fault_pause_s = 0.0
    log.warning("sim engine %s: fault %s", backend.role.engine_id, json.dumps(body))
    return state(backend)


def state(backend: SimBackend) -> dict[str, Any]:
    e = backend.engine
    return {"engine": "sim", "slow_step": e.slowdown if e else 1.0,
            "stall_transfer_s": backend.reader.fault_pause_s if backend.reader else 0.0,
            "killed": bool(e is not None and e.dead is not None)}


def routes(backend: SimBackend) -> list[tuple[str, Callable[[Request], Awaitable[JSONResponse]], list[str]]]:
    async def fault(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body() or b"null")
            return JSONResponse(await apply(backend, body))
        except (ValueError, FaultError) as exc:  # JSON errors are ValueErrors too
            return JSONResponse({"error": f"invalid fault: {exc}"}, status_code=400)

    return [("/sim/fault", fault, ["POST"])]
