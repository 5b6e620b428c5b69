"""The KV holds a prefill worker handed out, so a frontend can free one early.

When the prefill's own token ends a request (EOS, a stop string, `max_tokens: 1`), no decode
worker will read its blocks; the frontend then calls `POST /kv/release` with the request's
id, and the worker sends its engine's holder the same side-channel `Release` a decode
worker sends after its READ. Only holds this worker handed out can be released (the
endpoint is no relay to other side channels), and each record lives as long as its lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvtransfer.errors import HandshakeError
from kvtransfer.protocol import TransferParams
from kvtransfer.side_channel import release_once
from serve import protocol as p

RELEASE_TIMEOUT_S = 2.0


class HeldTransfers:
    def __init__(self, engine_id: str, token: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine_id = engine_id
        self.token = token
        self.clock = clock
        self._held: dict[str, tuple[TransferParams, float]] = {}  # client request id -> (params, expiry)

    def remember(self, request_id: str, params: TransferParams) -> None:
        now = self.clock()
        for rid in [r for r, (_, expiry) in self._held.items() if expiry < now]:
            del self._held[rid]
        self._held[request_id] = (params, now + params.lease_seconds)

    def __len__(self) -> int:
        return len(self._held)

    def take(self, request_id: str) -> TransferParams | None:
        held = self._held.pop(request_id, None)
        if held is None or held[1] < self.clock():
            return None
        return held[0]

    async def release(self, request_id: str) -> p.ReleaseReply:
        params = self.take(request_id)
        if params is None:
            return p.ReleaseReply(released=False, message="no KV held for this request (read, released or expired)")
        try:
            reply = await asyncio.to_thread(release_once, params.side_channel, params.request_id, self.engine_id,
                                            self.token, RELEASE_TIMEOUT_S)
        except HandshakeError as exc:
            return p.ReleaseReply(released=False, message=str(exc))
        return p.ReleaseReply(released=reply.status == "ok", message=reply.message)
