"""KV transfer between simulated workers, over the real side channel.

A prefill-role worker is a *holder*: a finished remote-decode request keeps its blocks
under a lease in kvtransfer's own `LeaseTable`, and the real `SideChannelServer` answers
Hello (this engine's metadata, compatibility hash included), Acquire and Release (HMAC'd
with the cluster token when there is one). A decode-role worker is a *reader*: it
handshakes with the holder, checks compatibility, acquires, "reads" (no NIXL: the bytes a
READ would move are counted and, with a bandwidth set, take their time), and releases. A
holder that answers "gone" (lease expired), or does not answer, fails the load: the
request is computed locally and counted as a failure and a recompute, exactly the metrics
a vLLM worker exports (`kvtransfer.metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from kvtransfer.errors import HandshakeError
from kvtransfer.layout import KVLayout, Region
from kvtransfer.leases import LeaseTable
from kvtransfer.metrics import KvStats
from kvtransfer.protocol import (
    PROTOCOL_VERSION, Acquire, EngineMetadata, Hello, Release, Reply, TransferParams, check_compatible, engine_auth,
)
from kvtransfer.side_channel import SideChannelClient, SideChannelServer
from serve.sim.blocks import BlockTable
from serve.sim.engine import SimRequest

log = logging.getLogger("pdserve.sim.kv")

SETTLE_S = 0.05  # how often the holder frees released and expired holds
SIM_AGENT = b"simulated: no NIXL agent"


def sim_metadata(engine_id: str, model: str, kv_cache_dtype: str, block_size: int, num_blocks: int,
                 num_layers: int, bytes_per_block_layer: int, side_channel: str) -> EngineMetadata:
    """This simulated engine's handshake metadata: the same fields a vLLM engine sends, with a
    layout of `num_layers` regions that exist only as numbers."""
    layers = [[Region(base=0, stride=bytes_per_block_layer, block_bytes=bytes_per_block_layer)]
              for _ in range(num_layers)]
    layout = KVLayout(num_blocks=num_blocks, block_size=block_size, layers=layers, device="DRAM",
                      layout_name="simulated")
    return EngineMetadata(protocol_version=PROTOCOL_VERSION, engine_id=engine_id, model=model, dtype="sim",
                          kv_cache_dtype=kv_cache_dtype, block_size=block_size, tp_size=1, layout=layout,
                          agent_name=engine_id, agent_metadata=SIM_AGENT, side_channel=side_channel)


class StatsBox:
    """KV stats counted between two reports (thread-safe: the side channel counts too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KvStats()

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def read(self, seconds: float, nbytes: int, blocks: int) -> None:
        with self._lock:
            s = self._stats
            s.reads += 1
            s.blocks_read += blocks
            s.bytes_read += nbytes
            s.read_seconds = [*s.read_seconds, seconds]
            s.read_bytes = [*s.read_bytes, nbytes]

    def take(self, held_blocks: int | None) -> KvStats:
        with self._lock:
            out, self._stats = self._stats, KvStats()
        out.held_blocks = held_blocks
        return out


class Holder:
    """The prefill side: holds finished requests' blocks for their readers."""

    def __init__(self, table: BlockTable, metadata: Callable[[], EngineMetadata], bind: str, lease_s: float,
                 read_timeout_s: float, token: str | None, stats: StatsBox,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.lease_s = lease_s
        self.stats = stats
        self.leases = LeaseTable(read_timeout_s, clock=clock)
        self.server = SideChannelServer(bind, metadata, self._on_acquire, self._on_release, token)
        self.engine_id = ""  # set by the backend once the metadata is known
        self._held = 0
        self._task: asyncio.Task | None = None

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def start(self) -> None:
        self._task = asyncio.create_task(self._settle_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.to_thread(self.server.close)

    def hold(self, req: SimRequest, advertised: str) -> TransferParams:
        blocks = self.table.blocks_of(req.request_id)
        self.leases.hold(req.request_id, len(blocks), self.lease_s)
        self.leases.settle([req.request_id])
        self.stats.add(requests_held=1)
        return TransferParams(engine_id=self.engine_id, request_id=req.request_id, block_ids=blocks,
                              num_tokens=len(req.prompt), side_channel=advertised, lease_seconds=self.lease_s)

    def abort(self, request_id: str) -> bool:
        """An abort frees a hold at once."""
        if self.leases.release(request_id):
            self.settle()
            return True
        return False

    @property
    def held_blocks(self) -> int:
        """Blocks held for readers, as of the last settle."""
        return self._held

    def settle(self) -> None:
        done = self.leases.settle([])
        for rid in done.sending:
            self.table.free(rid)
        self._held = done.held_blocks
        if done.blocks_released or done.lease_expiries:
            self.stats.add(blocks_released=done.blocks_released, lease_expiries=done.lease_expiries)

    async def _settle_loop(self) -> None:
        while True:
            await asyncio.sleep(SETTLE_S)
            self.settle()

    def _on_acquire(self, msg: Acquire) -> Reply:
        return self.leases.acquire(msg.request_id)

    def _on_release(self, msg: Release) -> Reply:
        return Reply("ok") if self.leases.release(msg.request_id) else Reply("gone", "not held")


def transfer_seconds(nbytes: int, bandwidth_gbps: float, latency_s: float) -> float:
    """A modelled READ: its bytes over the link's bandwidth plus the per-READ latency (no
    bandwidth: the bytes take no time)."""
    return latency_s + (nbytes / (bandwidth_gbps * 1e9) if bandwidth_gbps > 0 else 0.0)


class Reader:
    """The decode side: loads a request's KV from its holder, or says why it cannot."""

    def __init__(self, local: Callable[[], EngineMetadata], token: str | None, timeout_s: float,
                 bandwidth_gbps: float, stats: StatsBox, fault_pause_s: float = 0.0, latency_s: float = 0.0,
                 speedup: float = 1.0) -> None:
        self.local = local
        self.latency_s = latency_s
        self.speedup = speedup
        self.fault_pause_s = fault_pause_s  # test-only: wait this long before each acquire
        self.token = token
        self.timeout_s = timeout_s
        self.bandwidth_gbps = bandwidth_gbps
        self.stats = stats
        self._clients: dict[str, SideChannelClient] = {}
        self._peers: dict[str, str] = {}  # side channel -> engine id whose handshake passed
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    async def load(self, params: TransferParams) -> bool:
        """True once the blocks were read (and released); False: compute the prompt locally."""
        if self.fault_pause_s:
            await asyncio.sleep(self.fault_pause_s)
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self._acquire, params)
        except HandshakeError as exc:
            log.warning("sim kv: load of %s from %s failed: %s", params.request_id, params.engine_id, exc)
            self.stats.add(failures=1, recomputes=1)
            return False
        local = self.local()
        nbytes = len(params.block_ids) * local.layout.bytes_per_block
        wait = transfer_seconds(nbytes, self.bandwidth_gbps, self.latency_s) / self.speedup
        if wait > 0:
            await asyncio.sleep(wait)
        await asyncio.to_thread(self._release, params)
        self.stats.read(time.monotonic() - t0, nbytes, len(params.block_ids))
        return True

    def _client(self, endpoint: str) -> SideChannelClient:
        c = self._clients.get(endpoint)
        if c is None:
            c = self._clients[endpoint] = SideChannelClient(endpoint, self.timeout_s)
        return c

    def _call(self, endpoint: str, msg: Hello | Acquire | Release) -> Reply:
        with self._lock:
            return self._client(endpoint).call(msg)

    def _acquire(self, params: TransferParams) -> None:
        local = self.local()
        auth = engine_auth(self.token, local.engine_id)
        if self._peers.get(params.side_channel) != params.engine_id:
            reply = self._call(params.side_channel, Hello(PROTOCOL_VERSION, local.engine_id, auth))
            if reply.status != "ok" or reply.metadata is None:
                raise HandshakeError(f"handshake refused: {reply.message}")
            check_compatible(local, reply.metadata)
            if reply.metadata.engine_id != params.engine_id:
                raise HandshakeError(f"holder restarted: {reply.metadata.engine_id} is not {params.engine_id}")
            self._peers[params.side_channel] = params.engine_id
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._call(params.side_channel, Acquire(params.request_id, local.engine_id, auth))
            if reply.status == "ok":
                return
            if reply.status != "pending" or time.monotonic() > deadline:
                raise HandshakeError(f"acquire: {reply.status}: {reply.message}")
            time.sleep(0.01)

    def _release(self, params: TransferParams) -> None:
        local = self.local()
        try:
            self._call(params.side_channel, Release(params.request_id, local.engine_id,
                                                    engine_auth(self.token, local.engine_id)))
            self.stats.add(releases_sent=1)
        except HandshakeError as exc:  # the holder's lease frees the blocks anyway
            log.warning("sim kv: release of %s failed: %s", params.request_id, exc)
