"""Prefill side of the worker (holder): the lease table behind the side channel, and the
thread that keeps NIXL progressing while a reader reads.

The side channel's `Acquire` and `Release` go straight to the `LeaseTable`. Between an
acquire and its release (or expiry) a small thread calls into NIXL every
HOLDER_PROGRESS_S: with NIXL's progress thread off, a READ over a software transport
completes only while the holder calls in, and an idle holder engine takes no steps. The
thread also sweeps expired leases, so a reader that died mid-read does not keep it
polling until the engine's next step; with no read in flight it sleeps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtransfer.leases import LeaseTable
from kvtransfer.nixl_agent import NixlAgent
from kvtransfer.protocol import Acquire, EngineMetadata, Release, Reply
from kvtransfer.side_channel import SideChannelServer, unpin_thread

log = logging.getLogger("vllm.pdserve.kvtransfer.worker")

HOLDER_PROGRESS_S = 0.001  # holder-side NIXL progress interval while a read is in flight
IDLE_WAKE_S = 1.0  # with no read in flight, sweep leases at least this often


class Holder:
    def __init__(self, leases: LeaseTable) -> None:
        self.leases = leases
        self.server: SideChannelServer | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, agent: NixlAgent, bind_endpoint: str, metadata: Callable[[], EngineMetadata | None],
              token: str | None) -> str:
        """Serve the side channel and start the progress thread (once, at KV registration);
        the endpoint the side channel bound."""
        self.server = SideChannelServer(bind_endpoint, metadata, self.on_acquire, self.on_release, token=token)
        self._thread = threading.Thread(target=self._progress, args=(agent,), name="pdserve-kv-holder-progress",
                                        daemon=True)
        self._thread.start()
        return self.server.endpoint

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
        self.leases.release(msg.request_id)
        return Reply("ok")

    def _progress(self, agent: NixlAgent) -> None:
        unpin_thread()  # never compete with the engine thread for its core
        while not self._stopping:
            self.leases.sweep()
            if not self.leases.reading():
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
