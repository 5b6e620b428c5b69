"""Worker side of PdConnector: moves bytes. Owns the NIXL agent, the side channel and
the lease table; runs in vLLM's worker process.

Prefill engine (holder): blocks of a finished remote-decode request are held until the
decode side releases them, or until the lease (`lease_seconds`) runs out unread; either
way they are reported in `finished_sending` and vLLM frees them. While a reader holds an
acquire, the lease is pinned for `read_timeout_s` + 5 s, longer than the reader waits
for its READ (the reader's deadline counts from before the acquire, and a READ seen done
past it is discarded), so a READ the reader accepts never raced a free, and a reader that
dies mid-read cannot strand blocks. Between an acquire and its release a small thread keeps
calling into NIXL: with the progress thread off, a READ over a software transport completes
only while the holder makes progress, and an idle holder engine takes no steps.

Decode engine (reader): for each planned load, handshake with the holder (cached per
engine, redone when it restarts), acquire the request's blocks, and post one NIXL READ
with merged descriptors. `get_transfer_results` polls the READs; a finished one releases
the holder. A holder that answers "gone" (lease expired) or a READ that fails or times out
makes the request fail its load, and vLLM recomputes the prompt locally (policy
`recompute`), counted in `recomputes`; freed memory is never read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransfer import transport
from kvtransfer.errors import HandshakeError, TransferFailed
from kvtransfer.layout import KVLayout, layout_from_tensors, merge_descriptors
from kvtransfer.protocol import (
    PROTOCOL_VERSION, Acquire, EngineMetadata, Hello, Release, Reply, TransferParams, check_compatible, cluster_token,
    engine_auth,
)
from kvtransfer.scheduler import LoadSpec, PdConnectorMetadata
from kvtransfer.side_channel import SideChannelClient, SideChannelServer
from kvtransfer.stats import PdKVStats

log = logging.getLogger("vllm.pdserve.kvtransfer.worker")

ACQUIRE_PENDING_RETRY_S = 0.02
SLOW_PREPARE_S = 1.0
HOLDER_PROGRESS_S = 0.001  # holder-side NIXL progress interval while a read is in flight
READ_PIN_MARGIN_S = 5.0
SPIN_S = 0.05  # longest a READ is progressed inline before it is left to the per-step poll
FREED_MEMORY = 4096  # ids remembered after freeing, to answer "gone" rather than "pending"
FINISHED_GRACE_S = 30.0  # how long a finished id with no hold is kept, in case its hold is late


@dataclass
class Hold:
    blocks: int
    expiry: float
    reading: bool = False


@dataclass
class Read:
    spec: LoadSpec
    handle: Any
    peer: str
    nbytes: int
    started: float
    deadline: float
    finished_at: float | None = None  # when an inline progress loop saw it complete


@dataclass
class Peer:
    """A holder engine this reader has shaken hands with. `agent_name` is set by the engine
    thread once the NIXL agent is added (NIXL calls stay on that thread)."""

    metadata: EngineMetadata
    client: SideChannelClient
    lock: threading.Lock = field(default_factory=threading.Lock)  # REQ sockets are not thread-safe
    agent_name: str | None = None


@dataclass
class Preparing:
    spec: LoadSpec
    future: Future
    created: float = 0.0  # before the acquire was sent: the read's deadline counts from here


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
    fault_pause_s: float = 0.0  # test-only: pause before posting a READ (never set in production)
    extra: dict = field(default_factory=dict)


FAULT_PAUSE_FILE_ENV = "PDSERVE_KV_FAULT_PAUSE_FILE"


def _fault_pause_from_file() -> float:
    """Test-only fault hook: while the file named by PDSERVE_KV_FAULT_PAUSE_FILE exists, each
    READ pauses for the seconds it holds before it starts (never set in production)."""
    path = os.environ.get(FAULT_PAUSE_FILE_ENV)
    if not path:
        return 0.0
    try:
        with open(path) as f:
            return max(0.0, float(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0.0


class PdWorker:
    def __init__(self, cfg: WorkerConfig, num_blocks: int) -> None:
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.layout: KVLayout | None = None
        self.agent: Any = None
        self.metadata: EngineMetadata | None = None
        self.server: SideChannelServer | None = None
        self.stats = PdKVStats()
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._freed: OrderedDict[str, None] = OrderedDict()
        self._to_free: set[str] = set()
        # Finished requests whose blocks may wait on a reader: rid -> when vLLM reported it.
        # One that is neither held nor awaiting its free is forgotten after FINISHED_GRACE_S,
        # so the ids of requests that never held blocks (every decode-side request, every
        # abort) do not accumulate for the life of the engine.
        self._finished_seen: dict[str, float] = {}
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()
        # Side-channel round trips (handshake, acquire, release) run here, so an engine step
        # never waits on the network or on a slow holder.
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-kv-io",
                                      initializer=_unpin_thread)
        self._preparing: dict[str, Preparing] = {}
        self._token = cluster_token()
        self._auth = engine_auth(self._token, cfg.engine_id)
        self._reads: dict[str, Read] = {}
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # Counted by the side-channel thread under the lock, folded into stats per step.
        self._released_blocks = 0
        # Holder-side progress while a reader is reading: with NIXL's progress thread off, a
        # READ on a software transport completes only while the holder calls into NIXL, and an
        # idle engine takes no steps. This thread progresses only between an acquire and the
        # matching release/expiry, so it costs nothing when no read is in flight.
        self._wake = threading.Event()
        self._stopping = False
        self._progress_thread: threading.Thread | None = None
        self._expiries = 0
        self._releases_sent = 0
        self._stale_agents: list[str | None] = []  # removed from NIXL on the engine thread

    # -- setup ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.layout = layout_from_tensors(kv_caches, self.num_blocks, self.cfg.block_size)
        applied = transport.apply(self.cfg.transport)
        name = f"pdserve-{self.cfg.engine_id}-{uuid.uuid4().hex[:6]}"
        # STRICT: the holder-progress thread calls into the agent beside the engine thread.
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[],
                                                        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        mode = "none" if self.cfg.transport == "shm" else "peer"
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        spans = self.layout.spans()
        self.agent.register_memory([(a, n, self.layout.device_id, "") for a, n in spans], self.layout.device)
        self.server = SideChannelServer(self.cfg.bind_endpoint, lambda: self.metadata,
                                        self._on_acquire, self._on_release, token=self._token)
        self._progress_thread = threading.Thread(target=self._progress_holds, name="pdserve-kv-holder-progress",
                                                 daemon=True)
        self._progress_thread.start()
        self.metadata = EngineMetadata(
            protocol_version=PROTOCOL_VERSION, engine_id=self.cfg.engine_id, model=self.cfg.model,
            dtype=self.cfg.dtype, kv_cache_dtype=self.cfg.kv_cache_dtype, block_size=self.cfg.block_size,
            tp_size=self.cfg.tp_size, layout=self.layout, agent_name=name,
            agent_metadata=self.agent.get_agent_metadata(), side_channel=self.cfg.advertise_endpoint,
        )
        log.info("kvtransfer: engine %s registered %d KV regions (%.1f MiB, %d blocks x %d B, %s, %s) "
                 "transport=%s %s side channel %s", self.cfg.engine_id, len(spans),
                 sum(n for _, n in spans) / 2**20, self.num_blocks, self.layout.bytes_per_block,
                 self.layout.device, self.layout.layout_name, self.cfg.transport, applied or "",
                 self.server.endpoint)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._progress_thread is not None:
            self._progress_thread.join(timeout=2)
        self._io.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        for peer in list(self._peers.values()):
            peer.client.close()

    # -- holder side ------------------------------------------------------------------
    def _forget(self, rid: str) -> None:
        self._freed[rid] = None
        while len(self._freed) > FREED_MEMORY:
            self._freed.popitem(last=False)

    def _on_acquire(self, msg: Acquire) -> Reply:
        now = time.monotonic()
        with self._lock:
            hold = self._holds.get(msg.request_id)
            if hold is None:
                if msg.request_id in self._freed or msg.request_id in self._to_free:
                    return Reply("gone", "blocks already freed (lease expired or released)")
                return Reply("pending", "not held yet")
            if now > hold.expiry and not hold.reading:
                self._expire(msg.request_id)
                return Reply("gone", "lease expired")
            hold.reading = True
            # Pinned for longer than the reader waits (its deadline counts from before this
            # acquire), so a READ the reader accepts never raced a free.
            hold.expiry = now + self.cfg.read_timeout_s + READ_PIN_MARGIN_S
        self._wake.set()
        return Reply("ok")

    def _on_release(self, msg: Release) -> Reply:
        with self._lock:
            hold = self._holds.pop(msg.request_id, None)
            if hold is not None:
                self._to_free.add(msg.request_id)
                self._released_blocks += hold.blocks
        return Reply("ok")

    def _progress_holds(self) -> None:
        _unpin_thread()  # never compete with the engine thread for its core
        while not self._stopping:
            # Expire here too: a reader that died mid-read must not keep this thread polling
            # until the (idle) engine's next step.
            self._sweep_leases()
            with self._lock:
                reading = any(h.reading for h in self._holds.values())
            if not reading:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                self.agent.get_new_notifs()
            except Exception:  # the agent is going away with the engine
                if self._stopping:
                    return
                log.exception("kvtransfer: holder progress failed")
            time.sleep(HOLDER_PROGRESS_S)

    def _expire(self, rid: str) -> None:
        """Caller holds the lock."""
        hold = self._holds.pop(rid)
        self._to_free.add(rid)
        self._expiries += 1
        log.info("kvtransfer: lease of %s expired (%d blocks freed unread)", rid, hold.blocks)

    def _sweep_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, h in self._holds.items() if now > h.expiry]:
                self._expire(rid)

    # -- reader side ------------------------------------------------------------------
    # Runs on an io thread: handshake (cached per engine), compatibility, acquire.
    def _prepare(self, spec: LoadSpec, queued_at: float) -> Peer:
        began = time.monotonic()
        pause = self.cfg.fault_pause_s or _fault_pause_from_file()
        if pause:
            time.sleep(pause)  # test-only: hold a transfer at this point
        remote = spec.remote
        peer = self._handshake(remote)
        shook = time.monotonic()
        try:
            check_compatible(self.metadata, peer.metadata)
        except HandshakeError as exc:
            self._release_now(remote)  # nobody can read these blocks: free them at once
            raise TransferFailed(str(exc)) from exc
        deadline = time.monotonic() + self.cfg.handshake_timeout_s
        while True:
            try:
                with peer.lock:
                    reply = peer.client.call(Acquire(remote.request_id, self.cfg.engine_id, self._auth))
            except HandshakeError as exc:  # holder unreachable: maybe restarted; handshake again next time
                self._forget_peer(remote.engine_id)
                raise TransferFailed(str(exc)) from exc
            if reply.status != "pending" or time.monotonic() >= deadline:
                took = time.monotonic() - began
                if took > SLOW_PREPARE_S:
                    log.warning("kvtransfer: acquire of %s took %.2f s (handshake %.2f s, answer %s, "
                                "queued %.2f s before it started)", remote.request_id, took, shook - began,
                                reply.status, began - queued_at)
            if reply.status == "ok":
                return peer
            if reply.status == "pending" and time.monotonic() < deadline:
                time.sleep(ACQUIRE_PENDING_RETRY_S)
                continue
            raise TransferFailed(f"holder {remote.engine_id} answered {reply.status}: {reply.message}")

    def _handshake(self, remote: TransferParams) -> Peer:
        with self._peers_lock:
            peer = self._peers.get(remote.engine_id)
        if peer is not None:
            return peer
        client = SideChannelClient(remote.side_channel, self.cfg.handshake_timeout_s)
        try:
            reply = client.call(Hello(PROTOCOL_VERSION, self.cfg.engine_id, self._auth))
        except HandshakeError as exc:
            client.close()
            raise TransferFailed(str(exc)) from exc
        md = reply.metadata
        if reply.status != "ok" or md is None:
            client.close()
            raise TransferFailed(f"handshake with {remote.side_channel} refused: {reply.message}")
        if md.engine_id != remote.engine_id:
            client.close()
            raise TransferFailed(f"{remote.side_channel} is engine {md.engine_id}, not {remote.engine_id} (restarted)")
        peer = Peer(md, client)
        with self._peers_lock:
            peer = self._peers.setdefault(remote.engine_id, peer)
        log.info("kvtransfer: handshake with engine %s at %s (compat %s)", md.engine_id, remote.side_channel,
                 md.compat_hash())
        return peer

    def _forget_peer(self, engine_id: str) -> None:
        with self._peers_lock:
            peer = self._peers.pop(engine_id, None)
        if peer is not None:
            peer.client.close()
            self._stale_agents.append(peer.agent_name)

    def _release_now(self, remote: TransferParams) -> None:
        """Tell the holder to free a request's blocks (io thread; errors only logged: the
        holder frees by lease anyway, nothing is stranded)."""
        try:
            with self._peers_lock:
                peer = self._peers.get(remote.engine_id)
            if peer is not None:
                with peer.lock:
                    peer.client.call(Release(remote.request_id, self.cfg.engine_id, self._auth))
            else:
                client = SideChannelClient(remote.side_channel, self.cfg.handshake_timeout_s)
                try:
                    client.call(Release(remote.request_id, self.cfg.engine_id, self._auth))
                finally:
                    client.close()
            self._releases_sent += 1
        except HandshakeError as exc:
            log.warning("kvtransfer: release of %s at %s failed: %s", remote.request_id, remote.engine_id, exc)
            self._forget_peer(remote.engine_id)

    def _release_remote(self, remote: TransferParams) -> None:
        self._io.submit(self._release_now, remote)

    # Runs on the engine thread: NIXL calls only.
    def _post_read(self, spec: LoadSpec, peer: Peer, acquired_by: float | None = None) -> None:
        assert self.layout is not None
        if peer.agent_name is None:
            name = self.agent.add_remote_agent(peer.metadata.agent_metadata)
            peer.agent_name = name.decode() if isinstance(name, bytes) else name
        t0 = time.monotonic()
        local, remote = merge_descriptors(peer.metadata.layout, self.layout, spec.remote_block_ids,
                                          spec.local_block_ids)
        ldev, rdev = self.layout.device_id, peer.metadata.layout.device_id
        ldesc = self.agent.get_xfer_descs(np.array([(a, n, ldev) for a, n in local], dtype=np.uint64),
                                          self.layout.device)
        rdesc = self.agent.get_xfer_descs(np.array([(a, n, rdev) for a, n in remote], dtype=np.uint64),
                                          peer.metadata.layout.device)
        handle = self.agent.initialize_xfer("READ", ldesc, rdesc, peer.agent_name, b"")
        state = self.agent.transfer(handle)
        # With the progress thread off, a READ advances only while we call into NIXL; on
        # shared memory the copy is done by this thread, so progress it right away (bounded)
        # instead of one poll per engine step.
        spin_until = time.monotonic() + SPIN_S
        while state == "PROC" and time.monotonic() < spin_until:
            state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            self._release_remote(spec.remote)
            raise TransferFailed(f"NIXL READ from {spec.remote.engine_id} failed to start")
        # Timed from the descriptor build: the READ may complete inside transfer() itself.
        self._reads[spec.request_id] = Read(spec, handle, spec.remote.engine_id, sum(n for _, n in local), t0,
                                            (acquired_by or t0) + self.cfg.read_timeout_s,
                                            time.monotonic() if state == "DONE" else None)

    def _start_prepared(self) -> None:
        for rid, prep in list(self._preparing.items()):
            if not prep.future.done():
                continue
            del self._preparing[rid]
            try:
                peer = prep.future.result()
                self._post_read(prep.spec, peer, prep.created)
            except TransferFailed as exc:
                self._fail(prep.spec, str(exc))
            except Exception as exc:  # never let a transfer problem take the engine down
                log.exception("kvtransfer: unexpected error starting the read of %s", rid)
                self._fail(prep.spec, f"{type(exc).__name__}: {exc}")
                self._release_remote(prep.spec.remote)

    def _fail(self, spec: LoadSpec, why: str) -> None:
        self.stats.data["failures"] += 1
        self.stats.data["recomputes"] += 1
        self._failed_recving.add(spec.request_id)
        self._done_recving.add(spec.request_id)
        log.warning("kvtransfer: load of %s failed (%s); recomputing locally", spec.request_id, why)

    def _poll_reads(self) -> None:
        now = time.monotonic()
        for rid, rd in list(self._reads.items()):
            state = self.agent.check_xfer_state(rd.handle)
            if state == "PROC" and now < rd.deadline:
                continue
            done_at = time.monotonic()
            del self._reads[rid]
            self.agent.release_xfer_handle(rd.handle)
            if state == "DONE" and (rd.finished_at or done_at) > rd.deadline:
                state = "LATE"  # past the deadline the holder may have freed the blocks: never use
            if state == "DONE":
                secs = (rd.finished_at or done_at) - rd.started
                d = self.stats.data
                d["reads"] += 1
                d["blocks_read"] += len(rd.spec.local_block_ids)
                d["bytes_read"] += rd.nbytes
                d["read_seconds"].append(secs)
                d["read_bytes"].append(rd.nbytes)
                self._done_recving.add(rid)
                log.info("kvtransfer: read %s: %d blocks, %d bytes in %.2f ms (%.2f GB/s)", rid,
                         len(rd.spec.local_block_ids), rd.nbytes, secs * 1e3, rd.nbytes / max(secs, 1e-9) / 1e9)
            else:
                self._fail(rd.spec, {"ERR": "READ error", "LATE": "READ completed past its deadline"}.get(
                    state, "READ timed out"))
            self._release_remote(rd.spec.remote)

    # -- per step -----------------------------------------------------------------------
    def start_load_kv(self, meta: PdConnectorMetadata) -> None:
        now = time.monotonic()
        if meta.holds:
            with self._lock:
                for rid, (nblocks, lease) in meta.holds.items():
                    self._holds[rid] = Hold(nblocks, now + lease)
                    self.stats.data["requests_held"] += 1
        for remote in meta.releases:
            self._release_remote(remote)
        for spec in meta.loads:
            now = time.monotonic()
            self._preparing[spec.request_id] = Preparing(spec, self._io.submit(self._prepare, spec, now), now)
        self._start_prepared()

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        now = time.monotonic()
        for rid in finished_req_ids:
            self._finished_seen.setdefault(rid, now)
        if self.agent is not None:
            self.agent.get_new_notifs()  # progress the holder side: the progress thread is off
            for name in self._stale_agents:
                if name is not None:
                    try:
                        self.agent.remove_remote_agent(name)
                    except Exception:  # the agent may already be gone with its process
                        pass
            self._stale_agents.clear()
            self._start_prepared()
            self._poll_reads()
        self._sweep_leases()
        with self._lock:
            sending = {r for r in self._to_free if r in self._finished_seen}
            self._to_free -= sending
            for r in sending:
                self._forget(r)
                del self._finished_seen[r]
            stale = []
            for r, t in self._finished_seen.items():  # oldest first (insertion order)
                if now - t <= FINISHED_GRACE_S:
                    break
                if r not in self._holds and r not in self._to_free:
                    stale.append(r)
            for r in stale:
                del self._finished_seen[r]
            self.stats.data["held_blocks"] = sum(h.blocks for h in self._holds.values())
            self.stats.data["blocks_released"] += self._released_blocks
            self.stats.data["lease_expiries"] += self._expiries
            self.stats.data["releases_sent"] += self._releases_sent
            self._released_blocks = self._expiries = self._releases_sent = 0
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        return sending, recving, failed

    def take_stats(self) -> PdKVStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, PdKVStats()
        return out


def _unpin_thread() -> None:
    """Let this helper thread run on any core: the engine process may be pinned to one core
    that its spinning OpenMP threads keep busy, which would starve the side channel."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):
        pass


def default_engine_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
