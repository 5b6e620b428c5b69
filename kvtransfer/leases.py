"""The prefill engine's lease table: which finished requests' blocks are held for a remote
decode, and when vLLM may free them. Pure bookkeeping: no threads, no NIXL, no sockets;
time comes from the injected clock, so tests and simulations run it on virtual time.

A request's blocks are held from its `hold` until the reader releases them or the lease
runs out unread; either way the request becomes *freed*, and is reported as sent (vLLM
frees its blocks) once vLLM has also reported it finished. An `acquire` pins the lease
for `read_timeout_s` + READ_PIN_MARGIN_S, longer than the reader waits for its READ (the
reader's deadline counts from before the acquire, and a READ seen done past it is
discarded), so a READ the reader accepts never raced a free, and a reader that dies
mid-read cannot strand blocks.

Freed ids are remembered (the last FREED_MEMORY of them) so a late acquire is answered
"gone" (recompute now) rather than "pending" (not held yet, retry). A finished id that is
neither held nor awaiting its free is forgotten after FINISHED_GRACE_S, so the ids of
requests that never held blocks (every decode-side request, every abort) do not
accumulate for the life of the engine.

Each public method is atomic (one internal lock): the side-channel thread, the holder
progress thread and the engine thread all call in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtransfer.protocol import Reply

log = logging.getLogger("vllm.pdserve.kvtransfer.worker")

READ_PIN_MARGIN_S = 5.0
FREED_MEMORY = 4096  # ids remembered after freeing, to answer "gone" rather than "pending"
FINISHED_GRACE_S = 30.0  # how long a finished id with no hold is kept, in case its hold is late


@dataclass
class Hold:
    blocks: int
    expiry: float
    reading: bool = False


@dataclass(frozen=True)
class Settled:
    """What one engine step learns from the table (`LeaseTable.settle`)."""

    sending: set[str]  # finished and freed: vLLM may free their blocks now
    held_blocks: int  # blocks still held, right now
    blocks_released: int  # released by their reader since the last settle
    lease_expiries: int  # freed unread by lease since the last settle


class LeaseTable:
    def __init__(self, read_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 freed_memory: int = FREED_MEMORY, finished_grace_s: float = FINISHED_GRACE_S) -> None:
        self.read_pin_s = read_timeout_s + READ_PIN_MARGIN_S
        self.clock = clock
        self.freed_memory = freed_memory
        self.finished_grace_s = finished_grace_s
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._freed: OrderedDict[str, None] = OrderedDict()
        self._to_free: set[str] = set()
        self._finished_seen: dict[str, float] = {}  # rid -> when vLLM reported it finished
        self._released_blocks = 0
        self._expiries = 0

    def hold(self, request_id: str, blocks: int, lease_s: float) -> None:
        """Hold a finished request's blocks until released or `lease_s` from now."""
        with self._lock:
            self._holds[request_id] = Hold(blocks, self.clock() + lease_s)

    def acquire(self, request_id: str) -> Reply:
        """A reader asks to read: "ok" (pinned), "pending" (not held yet) or "gone" (freed)."""
        now = self.clock()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                if request_id in self._freed or request_id in self._to_free:
                    return Reply("gone", "blocks already freed (lease expired or released)")
                return Reply("pending", "not held yet")
            if now > hold.expiry and not hold.reading:
                self._expire(request_id)
                return Reply("gone", "lease expired")
            hold.reading = True
            hold.expiry = now + self.read_pin_s
        return Reply("ok")

    def release(self, request_id: str) -> bool:
        """The reader is done (or needs nothing): free the blocks. False if not held."""
        with self._lock:
            hold = self._holds.pop(request_id, None)
            if hold is None:
                return False
            self._to_free.add(request_id)
            self._released_blocks += hold.blocks
            return True

    def sweep(self) -> int:
        """Free every hold past its expiry (pinned ones too: the pin outlasts any READ)."""
        now = self.clock()
        with self._lock:
            expired = [r for r, h in self._holds.items() if now > h.expiry]
            for rid in expired:
                self._expire(rid)
        return len(expired)

    def reading(self) -> bool:
        """Whether some reader holds an acquire (the holder must then progress NIXL)."""
        with self._lock:
            return any(h.reading for h in self._holds.values())

    def settle(self, finished_req_ids: Iterable[str]) -> Settled:
        """One engine step: note the requests vLLM reports finished, expire leases, and
        return which finished requests are freed (each reported once)."""
        now = self.clock()
        with self._lock:
            for rid in finished_req_ids:
                self._finished_seen.setdefault(rid, now)
            for rid in [r for r, h in self._holds.items() if now > h.expiry]:
                self._expire(rid)
            sending = {r for r in self._to_free if r in self._finished_seen}
            self._to_free -= sending
            for r in sending:
                self._forget(r)
                del self._finished_seen[r]
            stale = []
            for r, t in self._finished_seen.items():  # oldest first (insertion order)
                if now - t <= self.finished_grace_s:
                    break
                if r not in self._holds and r not in self._to_free:
                    stale.append(r)
            for r in stale:
                del self._finished_seen[r]
            out = Settled(sending, sum(h.blocks for h in self._holds.values()), self._released_blocks,
                          self._expiries)
            self._released_blocks = self._expiries = 0
        return out

    @property
    def finished_ids(self) -> frozenset[str]:
        """Finished ids still tracked (held, awaiting their free, or within the grace)."""
        with self._lock:
            return frozenset(self._finished_seen)

    def _expire(self, rid: str) -> None:
        """Caller holds the lock."""
        hold = self._holds.pop(rid)
        self._to_free.add(rid)
        self._expiries += 1
        log.info("kvtransfer: lease of %s expired (%d blocks freed unread)", rid, hold.blocks)

    def _forget(self, rid: str) -> None:
        """Caller holds the lock."""
        self._freed[rid] = None
        while len(self._freed) > self.freed_memory:
            self._freed.popitem(last=False)
