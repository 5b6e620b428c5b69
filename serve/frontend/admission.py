"""Bounded admission: at most `max_active` requests are served at once and at most
`max_queued` wait for a slot; the next one is refused (429 with Retry-After) before its body
is read, so a flood costs the frontend a bounded amount of memory:
(max_active + max_queued) request bodies at most. A queued request waits no longer than
its queue timeout (504), and that wait counts toward its request timeout.

    ticket = admission.enter()         # Overloaded when full
    try:
        ...read and validate the body...
        await ticket.wait(deadline)    # asyncio.TimeoutError past the deadline
        ...serve...
    finally:
        ticket.release()
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable


class Overloaded(Exception):
    """No room in the admission queue."""


class Ticket:
    def __init__(self, admission: Admission) -> None:
        self._a = admission
        self.active = False
        self._done = False

    async def wait(self, deadline: float) -> None:
        """Until this request holds a serving slot, or `deadline` (on the admission's clock) passes."""
        a = self._a
        if self.active:
            return
        if a.active < a.max_active and not a._waiters:
            a.active += 1
            a.queued -= 1
            self.active = True
            return
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        a._waiters.append(fut)
        try:
            async with asyncio.timeout(max(0.0, deadline - a.clock())):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                # the slot was handed over just as we gave up: pass it on
                self.active = True
            else:
                fut.cancel()
            raise
        finally:
            if fut in a._waiters:
                a._waiters.remove(fut)
        self.active = True

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        a = self._a
        if not self.active:
            a.queued -= 1
            return
        # Hand the slot straight to the oldest waiter (it stays counted as active).
        while a._waiters:
            fut = a._waiters.popleft()
            if not fut.done():
                a.queued -= 1
                fut.set_result(None)
                return
        a.active -= 1


class Admission:
    def __init__(self, max_active: int, max_queued: int, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the time base of deadlines (monotonic seconds; a simulation passes its own)."""
        if max_active < 1 or max_queued < 0:
            raise ValueError("max_active must be >= 1 and max_queued >= 0")
        self.clock = clock
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self.queued = 0  # entered, not yet serving (reading the body, or waiting for a slot)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def enter(self) -> Ticket:
        if self.active + self.queued >= self.max_active + self.max_queued:
            raise Overloaded(f"the server is at capacity ({self.max_active} requests in service, "
                             f"{self.max_queued} queued); retry later")
        self.queued += 1
        return Ticket(self)
