"""The frontend's prefill gate (`--max-prefills-per-worker`) on the virtual clock.

Split requests beyond `cap` prefills per prefill worker wait here, oldest first, for a worker
with room: one whose prefill ends (`kick`), or one that joins. The choice is the frontend's own
(`serve.frontend.prefillgate.room`: the router's pick if it has room, else the least loaded
worker with room). A request that waits longer than the frontend's `--prefill-timeout` is
handed back to its caller, which prefills on the decode worker, as the frontend does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from router.load import LoadTracker
from serve.frontend.prefillgate import room

from bench.sim.loop import Loop


@dataclass(eq=False)
class _Waiter:
    plan: Any  # serve.frontend.routing.RoutePlan
    granted: Callable[[Any], None]  # called with the plan, its prefill worker the one with room
    timed_out: Callable[[], None]
    deadline: float


class OfflineGate:
    def __init__(self, cap: int, load: LoadTracker, prefill_workers: Callable[[], Sequence[Any]], loop: Loop,
                 timeout_s: float) -> None:
        if cap < 1:
            raise ValueError(f"a prefill gate needs a cap >= 1, got {cap}")
        self.cap, self.load, self.prefill_workers = cap, load, prefill_workers
        self.loop, self.timeout_s = loop, timeout_s
        self._waiting: deque[_Waiter] = deque()
        self.held = 0  # requests waiting now
        self.timeouts = 0
        self._timer = False  # one expiry pending, for the oldest waiter (deadlines come in arrival order)

    def admit(self, plan: Any, granted: Callable[[Any], None], timed_out: Callable[[], None]) -> None:
        """`granted(plan)` now or later with a prefill worker that has room; `timed_out()` if
        none had room within the timeout. `granted` must reserve the worker's prefill load
        before it returns (the next choice counts it)."""
        if not self._waiting:
            worker = room(self.prefill_workers(), plan.prefill, self.load, self.cap)
            if worker is not None:
                granted(self._with(plan, worker))
                return
        w = _Waiter(plan, granted, timed_out, self.loop.now + self.timeout_s)
        self._waiting.append(w)
        self.held += 1
        if not self._timer:
            self._timer = True
            self.loop.at(w.deadline, self._expire)

    def kick(self) -> None:
        """Grant the oldest waiters while a worker has room (a prefill ended, a worker joined)."""
        while self._waiting:
            w = self._waiting[0]
            worker = room(self.prefill_workers(), w.plan.prefill, self.load, self.cap)
            if worker is None:
                return
            self._waiting.popleft()
            self.held -= 1
            w.granted(self._with(w.plan, worker))

    def _expire(self) -> None:
        self._timer = False
        # waiters leave only from the front (granted or expired), so the oldest holds the earliest deadline
        while self._waiting and self._waiting[0].deadline <= self.loop.now:
            w = self._waiting.popleft()
            self.held -= 1
            self.timeouts += 1
            w.timed_out()
        if self._waiting:
            self._timer = True
            self.loop.at(self._waiting[0].deadline, self._expire)

    @staticmethod
    def _with(plan: Any, worker: Any) -> Any:
        return plan if worker is plan.prefill else replace(plan, prefill=worker)
