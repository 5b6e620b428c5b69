"""How long this frontend's event loop has been stalled: time that worker leases do not count.

A frontend starved of CPU, or blocked by a long callback, reads a worker's lease renewal late:
the renewal waited in its socket queue. Counting that wait against the lease takes every
worker out of rotation at once after a long enough stall (2026-12-07, a live autoscaler run
with 76 processes on two cores: every decode worker's 10-s lease ran out in the same second
and 29 streams failed with "no decode worker available", though every worker was alive and
renewing). `LoopStall` ticks on the loop every `TICK_S`; whatever a tick oversleeps beyond
`SLACK_S` is stall, summed in `stalled_s`. The pool checks leases on monotonic time minus
that sum (`now_s`, read by `WorkerPool.lease_clock`), so a lease runs out only in time the
frontend could have read its renewal. A worker that really died still leaves rotation: its
polls fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable


class LoopStall:
    TICK_S = 0.1
    SLACK_S = 0.05  # ordinary scheduling jitter: not a stall

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.stalled_s = 0.0  # seconds of stall since start
        self.longest_s = 0.0  # the longest single stall
        self._task: asyncio.Task | None = None
        self._tick_from: float | None = None  # when the tick under way began

    def now_s(self) -> float:
        """`stalled_s` and the stall under way: a tick overdue now (code that runs just after
        a stall, before the tick lands, sees it)."""
        t0 = self._tick_from
        over = self.clock() - t0 - self.TICK_S if t0 is not None else 0.0
        return self.stalled_s + (over if over > self.SLACK_S else 0.0)

    def observe(self, overslept_s: float) -> None:
        """One tick woke `overslept_s` later than asked."""
        if overslept_s > self.SLACK_S:
            self.stalled_s += overslept_s
            self.longest_s = max(self.longest_s, overslept_s)

    async def run(self) -> None:
        try:
            while True:
                t0 = self._tick_from = self.clock()
                await asyncio.sleep(self.TICK_S)
                self.observe(self.clock() - t0 - self.TICK_S)
        finally:
            self._tick_from = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
