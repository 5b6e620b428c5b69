"""Prefill side of the worker (holder): the lease table behind the side channel, and the
thread that keeps NIXL progressing while a reader reads or a push writes.

The side channel's `Acquire` and `Release` go straight to the `LeaseTable`; `Push` (and the
decode engine's metadata from its handshake) to the `Pusher`, which WRITEs held blocks into
the decode engine's. Between an acquire and its release (or expiry), and while a WRITE is in
flight, a small thread calls into NIXL every HOLDER_PROGRESS_S: with NIXL's progress thread
off, a READ over a software transport completes only while the holder calls in, and an idle
holder engine takes no steps. The thread polls the WRITEs (each finished one frees its
lease; a late or failed one is cancelled) before it sweeps expired leases, so a reader that
died mid-read does not keep it polling until the engine's next step; idle, it sleeps. On a
decode engine it also runs while the engine's own READs are in flight (`also_busy`): a READ
that UCX moves in fragments then advances every HOLDER_PROGRESS_S, not once per engine
step (on a loaded core a step can take tens of milliseconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtransfer.leases import LeaseTable
from kvtransfer.nixl_agent import NixlAgent
from kvtransfer.protocol import Acquire, EngineMetadata, Push, Release, Reply
from kvtransfer.pusher import Pusher
from kvtransfer.side_channel import SideChannelServer, unpin_thread

log = logging.getLogger("vllm.pdserve.kvtransfer.worker")

HOLDER_PROGRESS_S = 0.001  # holder-side NIXL progress interval while a read is in flight
IDLE_WAKE_S = 1.0  # with no read in flight, sweep leases at least this often
# Progress a little longer after the last transfer ends: what UCX still has to send then
# (a WRITE's notification) goes out at once, not at the engine's next step.
PROGRESS_GRACE_S = 0.05


class Holder:
    def __init__(self, leases: LeaseTable, also_busy: Callable[[], bool] = lambda: False) -> None:
        self.leases = leases
        self.also_busy = also_busy  # this engine's own READs in flight: progress them too
        self.pusher = Pusher(leases, clock=leases.clock)
        self.agent: NixlAgent | None = None
        self._metadata: Callable[[], EngineMetadata | None] = lambda: None
        self.server: SideChannelServer | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, agent: NixlAgent, bind_endpoint: str, metadata: Callable[[], EngineMetadata | None],
              token: str | None) -> str:
        """Serve the side channel and start the progress thread (once, at KV registration);
        the endpoint the side channel bound."""
        self.agent, self._metadata = agent, metadata
        self.server = SideChannelServer(bind_endpoint, metadata, self.on_acquire, self.on_release, token=token,
                                        on_hello=self.pusher.peer, on_push=self.on_push)
        self._thread = threading.Thread(target=self._progress, name="pdserve-kv-holder-progress", daemon=True)
        self._thread.start()
        return self.server.endpoint

    def wake(self) -> None:
        """Start progressing now (a READ of this engine's was just posted)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.server is not None:
            self.server.close()

    # Side-channel thread.
    def on_acquire(self, msg: Acquire) -> Reply:
        reply = self.leases.acquire(msg.request_id)
        if reply.status == "ok":
            self._wake.set()
        return reply

    def on_release(self, msg: Release) -> Reply:
        if self.agent is not None:
            self.pusher.cancel(self.agent, msg.request_id, msg.engine_id)  # a WRITE stops before the answer
        self.leases.release(msg.request_id)
        return Reply("ok")

    def on_push(self, msg: Push) -> Reply:
        own = self._metadata()
        if self.agent is None or own is None:
            return Reply("pending", "KV caches not registered yet")
        reply = self.pusher.start(self.agent, own, msg)
        if reply.status == "ok":
            self._wake.set()
        return reply

    def _progress(self) -> None:
        unpin_thread()  # never compete with the engine thread for its core
        busy_until = 0.0
        while not self._stopping:
            agent = self.agent
            assert agent is not None
            try:
                self.pusher.poll(agent)
            except Exception:  # the agent is going away with the engine
                if self._stopping:
                    return
                log.exception("kvtransfer: holder push poll failed")
            self.leases.sweep()
            if self.leases.reading() or self.pusher.busy() or self.also_busy():
                busy_until = time.monotonic() + PROGRESS_GRACE_S
            elif time.monotonic() >= busy_until:
                self._wake.wait(timeout=IDLE_WAKE_S)
                self._wake.clear()
                continue
            try:
                agent.progress()
            except Exception:  # the agent is going away with the engine
                if self._stopping:
                    return
                log.exception("kvtransfer: holder progress failed")
            time.sleep(HOLDER_PROGRESS_S)
