"""The load tracker: what this frontend has in flight on each worker, per stage.

One object replaces the counters that used to be bumped by hand in several places. A
request reserves load on a worker for one stage (`prefill` or `decode`; an aggregated
worker's whole request counts as `decode`) and releases it when that stage ends:

    with tracker.reserve(worker_id, "decode", blocks):
        ...stream from the worker...

`requests(w)` counts reservations of every stage (what least-loaded picking uses);
`blocks(w, stage)` sums their blocks (what the prefill and decode costs use). No I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Stage = Literal["prefill", "decode"]
STAGES: tuple[Stage, ...] = ("prefill", "decode")


@dataclass(slots=True)
class _Load:
    requests: int = 0
    blocks: int = 0


CHANGE_LOG = 4096  # worker ids remembered for `changes_since` (older readers rebuild)


class LoadTracker:
    def __init__(self) -> None:
        self._load: dict[tuple[str, Stage], _Load] = {}
        self._changes: list[str] = []  # workers whose load changed, oldest first
        self._first = 0  # sequence number of _changes[0]

    @property
    def seq(self) -> int:
        """The sequence number of the next change."""
        return self._first + len(self._changes)

    def changes_since(self, seq: int) -> list[str] | None:
        """Workers whose load changed since `seq` (with repeats), or None if that is too long
        ago to say: what a cache of per-worker candidates patches instead of rebuilding."""
        if seq < self._first:
            return None
        return self._changes[seq - self._first:]

    def _changed(self, worker_id: str) -> None:
        self._changes.append(worker_id)
        if len(self._changes) > CHANGE_LOG:
            drop = CHANGE_LOG // 2
            del self._changes[:drop]
            self._first += drop

    def acquire(self, worker_id: str, stage: Stage, blocks: int = 0) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        load = self._load.get((worker_id, stage))
        if load is None:
            load = self._load[(worker_id, stage)] = _Load()
        load.requests += 1
        load.blocks += blocks
        self._changed(worker_id)

    def release(self, worker_id: str, stage: Stage, blocks: int = 0) -> None:
        load = self._load.get((worker_id, stage))
        if load is None:  # forgotten while reserved (the worker left the pool)
            return
        load.requests -= 1
        load.blocks -= blocks
        if load.requests == 0:
            del self._load[(worker_id, stage)]
        self._changed(worker_id)

    @contextlib.contextmanager
    def reserve(self, worker_id: str, stage: Stage, blocks: int = 0) -> Iterator[None]:
        """Hold `blocks` of `stage` load on `worker_id` for the `with` body."""
        self.acquire(worker_id, stage, blocks)
        try:
            yield
        finally:
            self.release(worker_id, stage, blocks)

    def requests(self, worker_id: str, stage: Stage | None = None) -> int:
        stages = STAGES if stage is None else (stage,)
        return sum(ld.requests for s in stages if (ld := self._load.get((worker_id, s))) is not None)

    def blocks(self, worker_id: str, stage: Stage) -> int:
        ld = self._load.get((worker_id, stage))
        return ld.blocks if ld is not None else 0

    def total_requests(self) -> int:
        return sum(ld.requests for ld in self._load.values())
