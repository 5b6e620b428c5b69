"""One engine's NIXL agent: its KV memory registered, peers' agents added and removed,
READs (pull) and notifying WRITEs (push) posted and polled, notifications collected. The
only module besides transport.py that touches NIXL's API; it knows nothing of leases,
requests or the side channel.

NIXL's own progress thread stays off (it halved throughput on 2 cores), so transfers
advance only while someone calls in: the reader polls its READs, the holder polls its
WRITEs and calls `progress()`, the engine calls `progress()` each step. Those calls come
from three threads (engine, holder progress, side channel), hence NIXL's STRICT
thread-sync mode. Every call that fetches notifications keeps them in one inbox
(`take_notifs`), so a notification is never lost to whichever thread happened to fetch it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from kvtransfer import transport
from kvtransfer.layout import KVLayout

XferState = Literal["DONE", "PROC", "ERR"]


class NixlAgent:
    def __init__(self, engine_id: str, transport_name: str, layout: KVLayout) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.layout = layout
        self.applied = transport.apply(transport_name)  # UCX reads its env when the agent starts
        self.name = f"pdserve-{engine_id}-{uuid.uuid4().hex[:6]}"
        self._agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=False, backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        mode = "none" if transport_name == "shm" else "peer"  # shm works only without error handling
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        self.spans = layout.spans()
        self._agent.register_memory([(a, n, layout.device_id, "") for a, n in self.spans], layout.device)
        self._inbox: list[bytes] = []
        self._inbox_lock = threading.Lock()
        self.on_notifs: Callable[[], None] | None = None  # called (on the progressing thread) when some arrive

    def metadata(self) -> bytes:
        """What a peer needs to add this agent (sent in the handshake)."""
        return self._agent.get_agent_metadata()

    def progress(self) -> None:
        """Call into NIXL so that peers' transfers with this engine's memory advance; keeps
        the notifications that arrive."""
        notifs = self._agent.get_new_notifs()
        if notifs:
            with self._inbox_lock:
                for msgs in notifs.values():
                    self._inbox.extend(msgs)
            if self.on_notifs is not None:
                self.on_notifs()

    def take_notifs(self) -> list[bytes]:
        """The notifications received since the last call (after one progress call)."""
        self.progress()
        with self._inbox_lock:
            out, self._inbox = self._inbox, []
        return out

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        self._agent.send_notif(remote_agent, msg)

    def add_remote(self, agent_metadata: bytes) -> str:
        name = self._agent.add_remote_agent(agent_metadata)
        return name.decode() if isinstance(name, bytes) else name  # bytes in nixl 1.5.1

    def remove_remote(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def post_read(self, remote_agent: str, remote_layout: KVLayout, local: Sequence[tuple[int, int]],
                  remote: Sequence[tuple[int, int]]) -> tuple[Any, XferState]:
        """Post one READ of the remote (addr, len) spans into the local ones; the handle and
        its first state (a small READ may be done already)."""
        return self._post("READ", remote_agent, remote_layout, local, remote, b"")

    def post_write(self, remote_agent: str, remote_layout: KVLayout, local: Sequence[tuple[int, int]],
                   remote: Sequence[tuple[int, int]], notif: bytes) -> tuple[Any, XferState]:
        """Post one WRITE of the local (addr, len) spans into the remote ones; the remote
        agent receives `notif` once every byte has landed."""
        return self._post("WRITE", remote_agent, remote_layout, local, remote, notif)

    def _post(self, op: str, remote_agent: str, remote_layout: KVLayout, local: Sequence[tuple[int, int]],
              remote: Sequence[tuple[int, int]], notif: bytes) -> tuple[Any, XferState]:
        ldesc = self._agent.get_xfer_descs(
            np.array([(a, n, self.layout.device_id) for a, n in local], dtype=np.uint64), self.layout.device)
        rdesc = self._agent.get_xfer_descs(
            np.array([(a, n, remote_layout.device_id) for a, n in remote], dtype=np.uint64), remote_layout.device)
        handle = self._agent.initialize_xfer(op, ldesc, rdesc, remote_agent, notif)
        return handle, self._agent.transfer(handle)

    def check(self, handle: Any) -> XferState:
        return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        """Free a transfer's handle; one still in flight is cancelled first (NIXL raises, and
        keeps the handle, when it cannot cancel it)."""
        self._agent.release_xfer_handle(handle)
