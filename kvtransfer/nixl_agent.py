"""One engine's NIXL agent: its KV memory registered, peers' agents added and removed, and
one-sided READs posted and polled. The only module besides transport.py that touches
NIXL's API; it knows nothing of leases, requests or the side channel.

NIXL's own progress thread stays off (it halved throughput on 2 cores), so transfers
advance only while someone calls in: the reader polls its READs, and the holder calls
`progress()`. Those calls come from two threads (the engine thread and the holder's
progress thread), hence NIXL's STRICT thread-sync mode.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
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

    def metadata(self) -> bytes:
        """What a peer needs to add this agent (sent in the handshake)."""
        return self._agent.get_agent_metadata()

    def progress(self) -> None:
        """Call into NIXL so that peers' READs of this engine's memory advance."""
        self._agent.get_new_notifs()

    def add_remote(self, agent_metadata: bytes) -> str:
        name = self._agent.add_remote_agent(agent_metadata)
        return name.decode() if isinstance(name, bytes) else name  # bytes in nixl 1.5.1

    def remove_remote(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def post_read(self, remote_agent: str, remote_layout: KVLayout, local: Sequence[tuple[int, int]],
                  remote: Sequence[tuple[int, int]]) -> tuple[Any, XferState]:
        """Post one READ of the remote (addr, len) spans into the local ones; the handle and
        its first state (a small READ may be done already)."""
        ldesc = self._agent.get_xfer_descs(
            np.array([(a, n, self.layout.device_id) for a, n in local], dtype=np.uint64), self.layout.device)
        rdesc = self._agent.get_xfer_descs(
            np.array([(a, n, remote_layout.device_id) for a, n in remote], dtype=np.uint64), remote_layout.device)
        handle = self._agent.initialize_xfer("READ", ldesc, rdesc, remote_agent, b"")
        return handle, self._agent.transfer(handle)

    def check(self, handle: Any) -> XferState:
        return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        self._agent.release_xfer_handle(handle)
