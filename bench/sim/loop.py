"""The offline simulator's virtual clock: a heap of timed callbacks, run in time order (ties
in the order they were scheduled). Nothing waits on wall time."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self.events = 0

    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` at virtual time `t` (now, if `t` is in the past)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = float("inf"), tick: Callable[[], None] | None = None, tick_every: int = 4096) -> None:
        """Run callbacks until none is left or the next is past `until`; `tick()` every
        `tick_every` callbacks (progress)."""
        heap = self._heap
        pop = heapq.heappop
        events = self.events
        try:
            while heap and heap[0][0] <= until:  # the simulator's innermost loop: locals only
                t, _, fn, args = pop(heap)
                self.now = t
                fn(*args)
                events += 1
                if tick is not None and events % tick_every == 0:
                    self.events = events
                    tick()
        finally:
            self.events = events

    def pending(self) -> int:
        return len(self._heap)
