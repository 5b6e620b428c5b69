"""The prefill gate: split requests wait in the frontend, oldest first, while every prefill
worker already has `cap` of this frontend's prefills (`--max-prefills-per-worker`).

Without it a request is sent to its prefill worker at once and queues in that engine. After
a burst, the backlog then stays on the workers that were there when it came: workers added
for it get only what arrives later (a live burst, 2026-12-06: 151 prompts waited 240 s on the
two old prefill workers while 16 new ones idled, and fell back to a local prefill). With the
gate, a worker with room, one finishing a prefill or one joining, takes the oldest waiter.

The gate reserves the worker's prefill load for the request it admits (LoadTracker.acquire);
the caller releases it when the prefill ends and calls `kick()`. No I/O; while requests
wait, one task re-checks every POLL_S for workers that joined or came back.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from router.load import LoadTracker

POLL_S = 0.25


class Worker(Protocol):
    url: str


W = TypeVar("W", bound=Worker)


class Plan(Protocol):
    prefill: Worker | None
    prompt_blocks: int


def room(workers: Sequence[W], prefer: W | None, load: LoadTracker, cap: int) -> W | None:
    """The prefill worker a waiting request may have now: `prefer` (the router's choice) if it
    is among `workers` with fewer than `cap` prefills, else the least loaded such worker; None
    when every worker is full (the offline simulator's gate, bench/sim/gate.py, shares it)."""
    if prefer is not None and any(w.url == prefer.url for w in workers) and load.requests(prefer.url, "prefill") < cap:
        return prefer
    best, least = None, cap
    for w in workers:
        n = load.requests(w.url, "prefill")
        if n < least:
            best, least = w, n
    return best


class PrefillGate:
    def __init__(self, cap: int, load: LoadTracker, prefill_workers: Callable[[], Sequence[Worker]]) -> None:
        if cap < 1:
            raise ValueError(f"a prefill gate needs a cap >= 1, got {cap}")
        self.cap = cap
        self.load = load
        self.prefill_workers = prefill_workers
        self._waiting: deque[tuple[asyncio.Future, Plan]] = deque()
        self._poller: asyncio.Task | None = None

    @property
    def held(self) -> int:
        """Requests waiting for a prefill worker with room now."""
        return sum(1 for fut, _ in self._waiting if not fut.done())

    def _room(self, prefer: Worker | None) -> Worker | None:
        return room(self.prefill_workers(), prefer, self.load, self.cap)

    def _grant(self, plan: Plan, worker: Worker) -> Plan:
        self.load.acquire(worker.url, "prefill", plan.prompt_blocks)
        return plan if worker is plan.prefill else dataclasses.replace(plan, prefill=worker)  # type: ignore[type-var]

    async def admit(self, plan: Plan, timeout_s: float) -> Plan | None:
        """`plan` with a prefill worker that has room, its load reserved; None if none had room
        within `timeout_s` (the caller then prefills on the decode worker)."""
        self.kick()
        if not self._waiting:
            worker = self._room(plan.prefill)
            if worker is not None:
                return self._grant(plan, worker)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.append((fut, plan))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        granted: Plan | None = None
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a result that lands
            # as its task is cancelled, swallowing the cancel.
            async with asyncio.timeout(max(timeout_s, 0.0)):
                granted = await asyncio.shield(fut)
            return granted
        except TimeoutError:
            return None
        finally:
            if not fut.done():
                fut.cancel()  # kick() drops it
            elif granted is None and not fut.cancelled():
                # Granted as this waiter timed out or was cancelled: hand the reservation back.
                late = fut.result()
                self.load.release(late.prefill.url, "prefill", late.prompt_blocks)
                self.kick()

    async def _poll(self) -> None:
        """While requests wait: every POLL_S, admit what workers that joined (or came back) have room for."""
        while self._waiting:
            await asyncio.sleep(POLL_S)
            self.kick()

    def kick(self) -> None:
        """Admit the oldest waiters while a worker has room."""
        while self._waiting:
            fut, plan = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            worker = self._room(plan.prefill)
            if worker is None:
                return
            self._waiting.popleft()
            fut.set_result(self._grant(plan, worker))
