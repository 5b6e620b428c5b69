"""Prefill side, push mode: WRITEs of held blocks into a decode engine's blocks.

A decode engine in push mode sends its own `EngineMetadata` in the handshake (`peer`), then
one `Push` per request: where its freshly allocated blocks are. `start` pins the lease (as
an acquire does), adds the decode's NIXL agent once, and posts one WRITE of the merged
descriptors with the request's notification tag (`protocol.notif_tag`): NIXL delivers it to
the decode engine once every byte has landed, and that is what the decode side waits for.
`poll` (the holder's progress thread) frees the lease of each finished WRITE; one that
fails, or runs past its deadline, is cancelled, its lease freed, and the decode engine told
at once (the tag with `FAILED_SUFFIX`) so it recomputes without waiting out its timeout.
`cancel` (a `Release`) cancels a WRITE still in flight before the reply goes back: after a
decode engine's release is answered, nothing more lands in its blocks. A release from anyone
else (the frontend freeing the hold of a client that left) also tells the decode engine that
its push failed, so it hands its blocks back at once instead of at its deadline; a WRITE
already done when the release comes counts as done (its notification is on its way).

Deadlines: a WRITE is given the decode side's remaining budget less DEADLINE_MARGIN_S, and
never longer than the lease pin less that margin, so a WRITE is cancelled both before the
decode side gives up on it and before its source blocks could be freed by lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.errors import HandshakeError
from kvtransfer.layout import merge_descriptors
from kvtransfer.leases import LeaseTable
from kvtransfer.metrics import KvStats
from kvtransfer.nixl_agent import NixlAgent
from kvtransfer.protocol import FAILED_SUFFIX, EngineMetadata, Hello, Push, Reply, check_compatible, notif_tag

log = logging.getLogger("vllm.pdserve.kvtransfer.worker")

DEADLINE_MARGIN_S = 1.0
CANCEL_WAIT_S = 2.0  # longest a release waits for a WRITE NIXL could not cancel at once


@dataclass
class Write:
    request_id: str
    handle: object
    target: str  # the decode engine's id
    peer_agent: str
    blocks: int
    nbytes: int
    started: float
    deadline: float


@dataclass
class Target:
    """A decode engine that may ask for pushes: its metadata, its agent once added."""

    metadata: EngineMetadata
    agent_name: str | None = None


class Pusher:
    def __init__(self, leases: LeaseTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.leases = leases
        self.clock = clock
        self.stats = KvStats()  # pushes, bytes_pushed, push_failures: taken with the holder's counters
        self._lock = threading.Lock()  # _writes, _targets and the NIXL calls on them
        self._targets: dict[str, Target] = {}
        self._writes: dict[str, Write] = {}

    def take_stats(self) -> KvStats:
        """The push counters since the last call."""
        with self._lock:
            out, self.stats = self.stats, KvStats()
        return out

    def busy(self) -> bool:
        with self._lock:
            return bool(self._writes)

    # -- side-channel thread ------------------------------------------------------------
    def peer(self, msg: Hello) -> None:
        """A handshake that carries the decode engine's metadata (push mode); a restarted
        engine (new agent) replaces its old entry."""
        if msg.metadata is None or msg.metadata.engine_id != msg.engine_id:
            return
        with self._lock:
            old = self._targets.get(msg.engine_id)
            if old is None or old.metadata.agent_name != msg.metadata.agent_name:
                self._targets[msg.engine_id] = Target(msg.metadata)

    def start(self, agent: NixlAgent, own: EngineMetadata, msg: Push) -> Reply:
        with self._lock:
            target = self._targets.get(msg.engine_id)
        if target is None:
            return Reply("error", f"push from {msg.engine_id} before a handshake with its metadata")
        try:
            check_compatible(own, target.metadata)
        except HandshakeError as exc:
            return Reply("error", str(exc))
        if len(msg.block_ids) != len(msg.holder_block_ids) or not msg.block_ids:
            return Reply("error", f"push of {len(msg.holder_block_ids)} blocks into {len(msg.block_ids)}")
        reply = self.leases.acquire(msg.request_id)  # pins the lease, or says pending / gone
        if reply.status != "ok":
            return reply
        now = self.clock()
        budget = min(msg.budget_s, self.leases.read_pin_s - DEADLINE_MARGIN_S) - DEADLINE_MARGIN_S
        if budget <= 0:
            self.leases.release(msg.request_id)
            return Reply("error", f"push budget {msg.budget_s:.2f} s is too short to write in")
        try:
            with self._lock:
                if target.agent_name is None:
                    target.agent_name = agent.add_remote(target.metadata.agent_metadata)
                src, dst = merge_descriptors(target.metadata.layout, own.layout, msg.block_ids,
                                             msg.holder_block_ids)
                handle, state = agent.post_write(target.agent_name, target.metadata.layout, src, dst,
                                                 notif_tag(msg.request_id))
                if state == "ERR":
                    agent.release(handle)
                    raise RuntimeError("NIXL WRITE failed to start")
                self._writes[msg.request_id] = Write(msg.request_id, handle, msg.engine_id, target.agent_name,
                                                     len(msg.holder_block_ids), sum(n for _, n in src), now,
                                                     now + budget)
        except Exception as exc:
            self.leases.release(msg.request_id)
            log.warning("kvtransfer: push of %s to %s failed to start: %s", msg.request_id, msg.engine_id, exc)
            with self._lock:
                self._targets.pop(msg.engine_id, None)  # re-added from its next handshake
            return Reply("error", f"{type(exc).__name__}: {exc}")
        return Reply("ok")

    def cancel(self, agent: NixlAgent, request_id: str, by_engine: str) -> None:
        """`by_engine` released the request: stop its WRITE (if any) before answering."""
        with self._lock:
            w = self._writes.pop(request_id, None)
            if w is None:
                return
            if agent.check(w.handle) == "DONE":
                self._done(agent, w)
            else:
                self._finish(agent, w, cancelled=by_engine == w.target)

    # -- holder progress thread ------------------------------------------------------------
    def poll(self, agent: NixlAgent) -> None:
        now = self.clock()
        with self._lock:
            for rid, w in list(self._writes.items()):
                state = agent.check(w.handle)
                if state == "PROC" and now < w.deadline:
                    continue
                del self._writes[rid]
                if state == "DONE":
                    self._done(agent, w)
                else:
                    log.warning("kvtransfer: push of %s %s", rid, "failed" if state == "ERR" else "timed out")
                    self._finish(agent, w, cancelled=False)

    # -- lock held ---------------------------------------------------------------------------
    def _done(self, agent: NixlAgent, w: Write) -> None:
        self._release_handle(agent, w)
        s = self.stats
        s.pushes += 1
        s.blocks_pushed += w.blocks
        s.bytes_pushed += w.nbytes
        log.info("kvtransfer: pushed %s: %d blocks, %d bytes in %.2f ms", w.request_id, w.blocks, w.nbytes,
                 (self.clock() - w.started) * 1e3)
        self.leases.release(w.request_id)

    def _finish(self, agent: NixlAgent, w: Write, cancelled: bool) -> None:
        """Cancel (or reap) a WRITE that will not be used, free its lease, and tell the decode
        side unless it is the one that asked (`cancelled`)."""
        self._release_handle(agent, w)
        self.leases.release(w.request_id)
        if not cancelled:
            self.stats.push_failures += 1
            try:
                agent.send_notif(w.peer_agent, notif_tag(w.request_id) + FAILED_SUFFIX)
            except Exception as exc:  # the decode engine may be gone; its own deadline covers it
                log.warning("kvtransfer: could not tell %s that its push failed: %s", w.peer_agent, exc)

    def _release_handle(self, agent: NixlAgent, w: Write) -> None:
        """Release the handle; one NIXL cannot cancel yet is polled until it settles (bounded)."""
        until = self.clock() + CANCEL_WAIT_S
        while True:
            try:
                agent.release(w.handle)
                return
            except Exception:
                if self.clock() > until:
                    log.error("kvtransfer: WRITE of %s could not be cancelled in %.0f s", w.request_id,
                              CANCEL_WAIT_S)
                    return
                agent.check(w.handle)
                time.sleep(0.001)
