"""Worker side of PdConnector: moves bytes; runs in vLLM's worker process. A thin wiring of
the roles, with the methods the connector calls:

    nixl_agent.NixlAgent   the engine's NIXL agent (registered KV memory, READs)
    leases.LeaseTable      prefill side: which finished requests' blocks are held, and until when
    holder.Holder          prefill side: the lease table behind the side channel, NIXL progress
                           while a reader reads
    reader.Reader          decode side: handshake, acquire, READ, release; failures recompute
    faults                 test-only fault hooks

Prefill engine (holder): blocks of a finished remote-decode request are held until the
decode side releases them, or until the lease (`lease_seconds`) runs out unread; either
way they are reported in `finished_sending` and vLLM frees them. While a reader holds an
acquire the lease is pinned past the reader's own deadline (leases.py), and a small thread
keeps calling into NIXL (holder.py). Decode engine (reader): see reader.py; a holder that
answers "gone", or a READ that fails or times out, makes the load fail and vLLM
recomputes the prompt locally, counted in `recomputes`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtransfer.holder import Holder
from kvtransfer.layout import KVLayout, layout_from_tensors
from kvtransfer.leases import LeaseTable
from kvtransfer.metrics import KvStats
from kvtransfer.nixl_agent import NixlAgent
from kvtransfer.protocol import PROTOCOL_VERSION, TRANSFER_MODES, EngineMetadata, cluster_token
from kvtransfer.reader import Reader
from kvtransfer.scheduler import PdConnectorMetadata
from kvtransfer.stats import PdKVStats

log = logging.getLogger("vllm.pdserve.kvtransfer.worker")

# An engine step that computes nothing, while loads are pending, waits up to this long for
# one of them to move on (a READ's completion is polled, not signalled: hence short).
IDLE_WAIT_S = 0.002


@dataclass
class WorkerConfig:
    engine_id: str
    bind_endpoint: str
    advertise_endpoint: str
    lease_seconds: float
    read_timeout_s: float
    handshake_timeout_s: float
    transport: str
    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    tp_size: int
    transfer_mode: str = "pull"  # resolved: push | pull (protocol.resolve_transfer_mode)
    fault_pause_s: float = 0.0  # test-only: pause before posting a READ (never set in production)


class PdWorker:
    def __init__(self, cfg: WorkerConfig, num_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.layout: KVLayout | None = None
        self.agent: NixlAgent | None = None
        self.metadata: EngineMetadata | None = None
        self.stats = KvStats()  # holder-side counters of this report; the reader keeps its own
        self._token = cluster_token()
        self.leases = LeaseTable(cfg.read_timeout_s, clock=clock)
        self.reader = Reader(cfg.engine_id, cfg.read_timeout_s, cfg.handshake_timeout_s, cfg.fault_pause_s,
                             token=self._token, clock=clock, mode=cfg.transfer_mode)
        # The holder's progress thread also runs while this engine's own READs are in flight.
        self.holder = Holder(self.leases, also_busy=self.reader.reading)
        self._idle = False  # this step's (PdConnectorMetadata.idle)
        self._begun: PdConnectorMetadata | None = None  # the step whose holds and releases are taken

    # -- setup ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.layout = layout_from_tensors(kv_caches, self.num_blocks, self.cfg.block_size)
        self.agent = agent = NixlAgent(self.cfg.engine_id, self.cfg.transport, self.layout)
        self.metadata = EngineMetadata(
            protocol_version=PROTOCOL_VERSION, engine_id=self.cfg.engine_id, model=self.cfg.model,
            dtype=self.cfg.dtype, kv_cache_dtype=self.cfg.kv_cache_dtype, block_size=self.cfg.block_size,
            tp_size=self.cfg.tp_size, layout=self.layout, agent_name=agent.name,
            agent_metadata=agent.metadata(), side_channel=self.cfg.advertise_endpoint, transfer_modes=TRANSFER_MODES,
        )
        self.reader.attach(agent, self.metadata)
        endpoint = self.holder.start(agent, self.cfg.bind_endpoint, lambda: self.metadata, self._token)
        spans = agent.spans
        log.info("kvtransfer: engine %s registered %d KV regions (%.1f MiB, %d blocks x %d B, %s, %s) "
                 "transport=%s %s mode=%s side channel %s", self.cfg.engine_id, len(spans),
                 sum(n for _, n in spans) / 2**20, self.num_blocks, self.layout.bytes_per_block,
                 self.layout.device, self.layout.layout_name, self.cfg.transport, agent.applied or "",
                 self.cfg.transfer_mode, endpoint)

    def shutdown(self) -> None:
        self.holder.stop()
        self.reader.close()

    # -- per step -----------------------------------------------------------------------
    def begin_step(self, meta: PdConnectorMetadata) -> None:
        """A step's holds and releases, taken when its metadata is bound: before its forward.
        vLLM calls start_load_kv after the forward is launched, which on a CPU means after it
        has run: a hold taken there waited for the whole next step (a batched prefill of 25 s
        in a 1P+1D run here), and the decode worker asking for those blocks meanwhile was told
        "not held yet" until it gave up and recomputed the prompt, stalling its decodes."""
        if meta is self._begun:
            return
        self._begun = meta
        for rid, (nblocks, lease) in meta.holds.items():
            self.leases.hold(rid, nblocks, lease)
            self.stats.requests_held += 1
        for remote in meta.releases:
            self.reader.release(remote)

    def start_load_kv(self, meta: PdConnectorMetadata) -> None:
        self.begin_step(meta)  # a no-op once the metadata's bind took them
        self._idle = meta.idle
        for spec in meta.loads:
            self.reader.load(spec)
        self.reader.start_prepared()
        if self.reader.reading():
            self.holder.wake()

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step."""
        if self.agent is not None:
            self.agent.progress()  # progress the holder side: the progress thread is off
        self.reader.step()
        if self.reader.reading():
            self.holder.wake()
        if self._idle and self.reader.idle_wait(IDLE_WAIT_S):
            self.reader.step()
        settled = self.leases.settle(finished_req_ids)
        self.stats.held_blocks = settled.held_blocks
        self.stats.blocks_released += settled.blocks_released
        self.stats.lease_expiries += settled.lease_expiries
        recving, failed = self.reader.take_finished()
        return settled.sending, recving, failed

    def take_stats(self) -> PdKVStats | None:
        out = self.stats.aggregate(self.holder.pusher.take_stats()).aggregate(self.reader.stats)
        if out.is_empty():
            return None
        self.stats, self.reader.stats = KvStats(), KvStats()
        return PdKVStats.of(out)


def default_engine_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
