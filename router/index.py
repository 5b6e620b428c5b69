"""Which blocks each worker holds: a prefix index fed by KV events or by the router's own
decisions (approximate mode). State only; scoring lives in `scoring.py`.

Blocks are keyed by `router.hashing` hashes. Events name blocks by the engine's own
hashes, so the index keeps, per worker, engine hash -> our hash: a stored block's parent
is found through it (chaining our hashes from the engine's parent) and a removed block is
dropped through it. In approximate mode (no events) a routed prompt's blocks are assumed
cached on the chosen worker until `ttl_s` after the last use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from router.hashing import ROOT, block_hashes


@dataclass
class WorkerBlocks:
    blocks: dict[int, float] = field(default_factory=dict)  # our hash -> expiry (inf with events)
    by_engine_hash: dict[object, int] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, block_size: int, ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.clock = clock
        self.workers: dict[str, WorkerBlocks] = {}
        self.holders: dict[int, dict[str, float]] = {}  # our hash -> {worker: expiry}: one walk scores all

    def _worker(self, worker: str) -> WorkerBlocks:
        return self.workers.setdefault(worker, WorkerBlocks())

    def remove_worker(self, worker: str) -> None:
        w = self.workers.pop(worker, None)
        if w is not None:
            for h in w.blocks:
                self._unhold(h, worker)

    def _hold(self, h: int, worker: str, expiry: float) -> None:
        self.workers[worker].blocks[h] = expiry
        self.holders.setdefault(h, {})[worker] = expiry

    def _unhold(self, h: int, worker: str) -> None:
        held = self.holders.get(h)
        if held is not None:
            held.pop(worker, None)
            if not held:
                del self.holders[h]

    def num_blocks(self) -> int:
        return sum(len(w.blocks) for w in self.workers.values())

    # -- producers --------------------------------------------------------------------
    def apply(self, worker: str, event: Event) -> None:
        w = self._worker(worker)
        if isinstance(event, BlockStored):
            parent = ROOT
            if event.parent_block_hash is not None:
                parent = w.by_engine_hash.get(_key(event.parent_block_hash), None)
                if parent is None:
                    return  # parent unknown (events missed): these blocks cannot be chained
            bs = event.block_size
            ours = block_hashes(event.token_ids[:len(event.block_hashes) * bs], bs, parent)  # full blocks only
            for engine_hash, h in zip(event.block_hashes, ours):
                self._hold(h, worker, float("inf"))
                w.by_engine_hash[_key(engine_hash)] = h
        elif isinstance(event, BlockRemoved):
            for engine_hash in event.block_hashes:
                ours = w.by_engine_hash.pop(_key(engine_hash), None)
                if ours is not None:
                    w.blocks.pop(ours, None)
                    self._unhold(ours, worker)
        elif isinstance(event, AllBlocksCleared):
            for h in w.blocks:
                self._unhold(h, worker)
            w.blocks.clear()
            w.by_engine_hash.clear()

    def record_routed(self, worker: str, hashes: Sequence[int]) -> None:
        """Approximate mode: the chosen worker will hold these blocks for a while."""
        expiry = self.clock() + self.ttl_s
        self._worker(worker)
        for h in hashes:
            self._hold(h, worker, expiry)

    def expire(self) -> None:
        now = self.clock()
        for name, w in self.workers.items():
            for h in [h for h, exp in w.blocks.items() if exp <= now]:
                del w.blocks[h]
                self._unhold(h, name)

    # -- reads ------------------------------------------------------------------------
    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading prompt blocks held, for every worker holding at least the first one,
        in one walk over the prompt (the set of matching workers only shrinks)."""
        now = self.clock()
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            held = self.holders.get(h)
            if not held:
                break
            here = {w for w, exp in held.items() if exp > now}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for w in alive:
                out[w] = i + 1
        return out

    def overlap(self, worker: str, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt that `worker` holds."""
        w = self.workers.get(worker)
        if w is None:
            return 0
        now = self.clock()
        n = 0
        for h in hashes:
            exp = w.blocks.get(h)
            if exp is None or exp <= now:
                break
            n += 1
        return n


def _key(engine_hash: object) -> object:
    return bytes(engine_hash) if isinstance(engine_hash, (bytes, bytearray, memoryview)) else engine_hash
