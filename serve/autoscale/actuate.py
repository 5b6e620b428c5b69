"""What an actuator is: the part of the autoscaler that turns a decision into workers.

`Actuator.apply(decision, rows)` moves every pool from the count the decision saw to the
one it wants: up by starting workers, down by retiring the workers it picks with
`pick_to_retire` (in rotation, fewest requests in flight, the newest first on a tie).
A retirement always goes through drain: the worker leaves rotation (`POST /internal/drain`),
finishes its streams and, for a prefill worker, waits until the blocks it holds are read or
their lease ends; only then is it stopped (local) or marked for deletion and the Deployment
scaled (Kubernetes). Retirements run in the background (a drain takes as long as the
longest stream); a draining worker is out of rotation, so the next decision does not count
it, and `starting()` reports the workers launched but not serving yet.

Implementations: serve/autoscale/local.py (the launcher's processes) and
serve/autoscale/kube.py (Deployments through the scale subresource).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from serve import protocol as p

log = logging.getLogger("pdserve.autoscale")
_DRAIN = p.decoder(p.DrainReply)


@dataclass
class Action:
    """One thing an actuator did (or failed to do), for GET /autoscaler and the log."""
    t: float
    pool: str
    kind: str  # "start" | "drain" | "stop" | "scale" | "error"
    target: str  # a worker URL, a Deployment, a pod
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"t": round(self.t, 3), "pool": self.pool, "kind": self.kind, "target": self.target,
                "detail": self.detail}


class ActionLog:
    """What an actuator did: the last `keep` Actions, each logged and told to `on_action`."""

    def __init__(self, keep: int = 200) -> None:
        self.actions: deque[Action] = deque(maxlen=keep)
        self.on_action: Callable[[Action], None] | None = None

    def _record(self, action: Action) -> Action:
        self.actions.append(action)
        if self.on_action is not None:
            self.on_action(action)
        log.info("actuator: %s %s %s%s", action.kind, action.pool, action.target,
                 f": {action.detail}" if action.detail else "")
        return action


class Actuator(Protocol):
    name: str

    actions: Any  # the last Actions, oldest first
    on_action: Callable[[Action], None] | None  # told of each Action as it happens

    async def starting(self, http: httpx.AsyncClient, rows: list[p.WorkerRow]) -> dict[str, int]:
        """Workers per pool launched and not serving yet (`rows`: the frontend's workers)."""
        ...

    async def apply(self, current: dict[str, int], desired: dict[str, int], rows: list[p.WorkerRow],
                    http: httpx.AsyncClient, starting: dict[str, int] | None = None) -> list[Action]:
        """Start or retire workers so each pool goes from `current` (serving + `starting`)
        to `desired`."""
        ...

    async def close(self) -> None:
        """Wait for (or cancel) retirements under way; start nothing new."""
        ...


def pick_to_retire(rows: Iterable[p.WorkerRow], pool: str, n: int, allowed: set[str] | None = None) -> list[str]:
    """The URLs of `n` workers of `pool` to retire: in rotation (a worker already leaving is
    not picked twice), among `allowed` when given (the ones this actuator can stop), fewest
    requests in flight first, then the latest in the list (the newest worker)."""
    cands = [(r.inflight, -i, r.url) for i, r in enumerate(rows)
             if r.role == pool and r.in_rotation and (allowed is None or r.url in allowed)]
    return [url for _, _, url in sorted(cands)[:max(0, n)]]


async def drain(http: httpx.AsyncClient, url: str, timeout_s: float) -> tuple[bool, str]:
    """`POST {url}/internal/drain?timeout=S`: (drained, what happened). The worker leaves
    rotation at once and answers when idle or after `timeout_s`; a worker that does not
    answer is reported, never waited on past `timeout_s` + 15 s."""
    try:
        r = await http.post(f"{url}/internal/drain", params={"timeout": timeout_s},
                            timeout=httpx.Timeout(timeout_s + 15.0))
        r.raise_for_status()
        reply = _DRAIN(r.content)
    except (httpx.HTTPError, ValueError) as exc:
        return False, f"drain failed: {type(exc).__name__}: {exc}"
    if reply.drained:
        return True, f"drained in {reply.waited_s:.1f} s"
    return False, f"{reply.active_requests} request(s) still in flight after {reply.waited_s:.1f} s"


@dataclass
class Background:
    """Retirements under way: tasks kept until done, their failures logged, all awaited on
    close (each has its own timeout)."""
    tasks: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Any, what: str) -> None:
        task = asyncio.create_task(coro, name=what)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed: %r", task.get_name(), task.exception())

    async def wait(self, timeout_s: float) -> None:
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()


def now() -> float:
    return time.time()
