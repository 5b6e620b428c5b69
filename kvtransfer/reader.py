"""Decode side of the worker (reader): brings a remote prefill's blocks into local blocks.

For each planned load, an io thread handshakes with the holder (cached per engine, redone
when it restarts; the handshake carries this engine's metadata, for pushes), checks
compatibility, then:

- pull: acquires the request's blocks; the engine thread posts one NIXL READ with merged
  descriptors (NIXL calls stay on that thread) and polls it each step. A finished READ
  releases the holder.
- push: sends `Push` (where the request's local blocks are); the holder WRITEs them and
  NIXL delivers its notification (`notif_tag`) once the bytes have landed; the engine
  thread watches for it each step, from the moment the load is planned (the notification
  alone proves the push was accepted: the io thread's "ok" can come later on a busy
  process). The holder frees its blocks itself after the WRITE.

A load uses push when its request (LoadSpec.mode) or else this engine wants it and the
holder serves it (`pair_mode`), else pull. A holder that answers "gone" (lease expired), an incompatible or unreachable holder,
or a transfer that fails or times out makes the request fail its load: vLLM recomputes the
prompt locally (policy `recompute`), counted in `recomputes`; freed memory is never read.
A load's deadline counts from before its acquire (or push); a READ seen done past it is
discarded (the holder's pin outlasts it); a push past it is released, and only once the
holder has answered (its WRITE cancelled: nothing lands later) or cannot be reached is the
load failed and the blocks handed back to vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvtransfer import faults
from kvtransfer.errors import HandshakeError, TransferFailed
from kvtransfer.inflight import Peer, Preparing, Pushed, Read
from kvtransfer.layout import merge_descriptors
from kvtransfer.metrics import KvStats
from kvtransfer.nixl_agent import NixlAgent
from kvtransfer.protocol import (
    FAILED_SUFFIX, PROTOCOL_VERSION, Acquire, EngineMetadata, Hello, LoadSpec, Push, Release, TransferParams,
    check_compatible, engine_auth, notif_tag, pair_mode,
)
from kvtransfer.side_channel import SideChannelClient, unpin_thread

log = logging.getLogger("vllm.pdserve.kvtransfer.worker")

ACQUIRE_PENDING_RETRY_S = 0.005  # the hold appears at the prefill engine's next step
SLOW_PREPARE_S = 1.0
SPIN_S = 0.05  # longest a READ is progressed inline before it is left to the per-step poll


class Reader:
    def __init__(self, engine_id: str, read_timeout_s: float, handshake_timeout_s: float,
                 fault_pause_s: float = 0.0, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 mode: str = "pull") -> None:
        self.engine_id = engine_id
        self.mode = mode  # wanted: "push" or "pull" (resolved); each pair may fall back to pull
        self.read_timeout_s = read_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.fault_pause_s = fault_pause_s
        self.clock = clock
        self.sleep = sleep
        self._auth = engine_auth(token, engine_id)
        self.agent: NixlAgent | None = None
        self.local: EngineMetadata | None = None
        self.stats = KvStats()  # reader-side counters, taken by the worker with its own
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()
        # Side-channel round trips (handshake, acquire, release) run here, so an engine step
        # never waits on the network or on a slow holder.
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-kv-io", initializer=unpin_thread)
        self._preparing: dict[str, Preparing] = {}
        self._reads: dict[str, Read] = {}
        self._pushes: dict[bytes, Pushed] = {}  # by notif_tag of the holder's request id
        # Notifications that came before their push was registered (the holder's WRITE can
        # finish before its "ok" reaches the engine thread): tag -> when seen.
        self._early: dict[bytes, float] = {}
        self._cancels: dict[str, tuple[LoadSpec, Future, str]] = {}  # late pushes being released
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._releases_sent = 0  # counted on io threads, folded into stats per step
        self._stale_agents: list[str | None] = []  # removed from NIXL on the engine thread
        self._wake = threading.Event()  # an acquire/push answered or a notification came: see idle_wait

    def attach(self, agent: NixlAgent, local: EngineMetadata) -> None:
        """The registered agent and this engine's metadata (once, at KV registration)."""
        self.agent, self.local = agent, local
        agent.on_notifs = self._wake.set

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
        for peer in list(self._peers.values()):
            peer.client.close()

    # -- engine thread ------------------------------------------------------------------
    def load(self, spec: LoadSpec) -> None:
        """Start preparing a planned load: handshake and acquire, on an io thread."""
        now = self.clock()
        fut = self._io.submit(self._prepare, spec, now)
        fut.add_done_callback(lambda _: self._wake.set())
        self._preparing[spec.request_id] = Preparing(spec, fut, now)

    def idle_wait(self, timeout_s: float) -> bool:
        """On an engine step that computes nothing (its requests all wait for KV): block up to
        `timeout_s` until an acquire or push is answered or a notification arrives, instead of
        returning to a busy loop that starves this process's io threads (traced: they ran
        20-400 ms late). Whether it was woken; at once when a load finished or none is pending."""
        if self._done_recving or not (self._preparing or self._reads or self._pushes or self._cancels):
            return False
        woken = self._wake.wait(timeout_s)
        self._wake.clear()
        return woken

    def reading(self) -> bool:
        """Whether READs are in flight or pushes awaited (read from another thread: a progress
        loop keeps them moving, and takes in notifications, between engine steps)."""
        return bool(self._reads or self._pushes)

    def release(self, remote: TransferParams) -> None:
        """Tell the holder to free a request's blocks (on an io thread)."""
        self._io.submit(self._release_now, remote)

    def step(self) -> None:
        """Per engine step, once KV caches are registered: drop agents of restarted holders,
        post the READs whose acquire came back, poll the READs in flight."""
        if self.agent is None:
            return
        with self._peers_lock:
            stale, self._stale_agents = self._stale_agents, []
        for name in stale:
            if name is not None:
                try:
                    self.agent.remove_remote(name)
                except Exception:  # the agent may already be gone with its process
                    pass
        self.start_prepared()
        self._poll_reads(self.agent)
        if self._pushes or self._cancels or self._preparing:
            self._poll_pushes(self.agent)

    def take_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose load finished since the last call (failed ones are in both sets)."""
        with self._peers_lock:
            self.stats.releases_sent += self._releases_sent
            self._releases_sent = 0
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        return recving, failed

    def start_prepared(self) -> None:
        for rid, prep in list(self._preparing.items()):
            # One push's registration polls notifications, which can complete a later one here.
            if not prep.future.done() or self._preparing.pop(rid, None) is None:
                continue
            try:
                peer, pushed_at = prep.future.result()
                if pushed_at is not None:
                    self._await_push(prep.spec, pushed_at, prep.created)
                else:
                    self._post_read(prep.spec, peer, prep.created)
            except TransferFailed as exc:
                self._fail(prep.spec, str(exc))
            except Exception as exc:  # never let a transfer problem take the engine down
                log.exception("kvtransfer: unexpected error starting the read of %s", rid)
                self._fail(prep.spec, f"{type(exc).__name__}: {exc}")
                self.release(prep.spec.remote)

    def _post_read(self, spec: LoadSpec, peer: Peer, acquired_by: float | None = None) -> None:
        agent, local = self.agent, self.local
        if agent is None or local is None:
            raise RuntimeError("KV caches are not registered")
        if peer.agent_name is None:
            peer.agent_name = agent.add_remote(peer.metadata.agent_metadata)
        t0 = self.clock()
        lspans, rspans = merge_descriptors(peer.metadata.layout, local.layout, spec.remote_block_ids,
                                           spec.local_block_ids)
        handle, state = agent.post_read(peer.agent_name, peer.metadata.layout, lspans, rspans)
        # With the progress thread off, a READ advances only while we call into NIXL; on
        # shared memory the copy is done by this thread, so progress it right away (bounded)
        # instead of one poll per engine step.
        spin_until = self.clock() + SPIN_S
        while state == "PROC" and self.clock() < spin_until:
            state = agent.check(handle)
        if state == "ERR":
            agent.release(handle)
            self.release(spec.remote)
            raise TransferFailed(f"NIXL READ from {spec.remote.engine_id} failed to start")
        # Timed from the descriptor build: the READ may complete inside transfer() itself.
        self._reads[spec.request_id] = Read(spec, handle, spec.remote.engine_id, sum(n for _, n in lspans), t0,
                                            (acquired_by or t0) + self.read_timeout_s,
                                            self.clock() if state == "DONE" else None)

    def _await_push(self, spec: LoadSpec, pushed_at: float, created: float) -> None:
        local = self.local
        nbytes = len(spec.local_block_ids) * local.layout.bytes_per_block if local is not None else 0
        self._pushes[notif_tag(spec.remote.request_id)] = Pushed(spec, nbytes, pushed_at,
                                                                 created + self.read_timeout_s)
        if self.agent is not None or self._early:
            self._poll_pushes(self.agent)  # its notification may be here already

    def _poll_pushes(self, agent: NixlAgent | None) -> None:
        now = self.clock()
        fresh = [(m, now) for m in agent.take_notifs()] if agent is not None else []
        early, self._early = self._early, {}
        for msg, seen in [*early.items(), *fresh]:
            failed = msg.endswith(FAILED_SUFFIX)
            tag = msg[:-len(FAILED_SUFFIX)] if failed else msg
            pushed = self._pushes.pop(tag, None) or self._accepted_early(tag)
            if pushed is None:
                # Not registered yet (kept a read timeout), or given up already (its release was
                # answered: then it is dropped with the expiry).
                if now - seen < self.read_timeout_s:
                    self._early[msg] = seen
                continue
            if failed:
                self._fail(pushed.spec, "the holder's WRITE failed or timed out")
                continue
            self._loaded("pushed to", pushed.spec, pushed.nbytes, self.clock() - pushed.started)
        now = self.clock()
        for tag, pushed in list(self._pushes.items()):
            if now >= pushed.deadline:
                # Not failed (blocks handed back) until the holder answers the release: its WRITE is
                # cancelled first, so nothing lands in blocks vLLM reuses.
                del self._pushes[tag]
                self._cancels[pushed.spec.request_id] = (pushed.spec, self._io.submit(self._release_now,
                                                                                        pushed.spec.remote),
                                                         "push timed out")
        for rid, (spec, fut, why) in list(self._cancels.items()):
            if fut.done():
                del self._cancels[rid]
                self._fail(spec, why)

    def _accepted_early(self, tag: bytes) -> Pushed | None:
        """A push whose notification came before its io thread saw the holder's "ok" (a busy
        process can take tens of milliseconds to run that thread): the notification alone
        proves the holder accepted it, so the load completes now and the io thread's answer
        is left unread."""
        for rid, prep in self._preparing.items():
            if notif_tag(prep.spec.remote.request_id) == tag:
                del self._preparing[rid]
                local = self.local
                nbytes = len(prep.spec.local_block_ids) * local.layout.bytes_per_block if local is not None else 0
                return Pushed(prep.spec, nbytes, prep.created, prep.created + self.read_timeout_s)
        return None

    def _poll_reads(self, agent: NixlAgent) -> None:
        now = self.clock()
        for rid, rd in list(self._reads.items()):
            state = agent.check(rd.handle)
            if state == "PROC" and now < rd.deadline:
                continue
            done_at = self.clock()
            del self._reads[rid]
            agent.release(rd.handle)
            if state == "DONE" and (rd.finished_at or done_at) > rd.deadline:
                state = "LATE"  # past the deadline the holder may have freed the blocks: never use
            if state == "DONE":
                self._loaded("read", rd.spec, rd.nbytes, (rd.finished_at or done_at) - rd.started)
            else:
                self._fail(rd.spec, {"ERR": "READ error", "LATE": "READ completed past its deadline"}.get(
                    state, "READ timed out"))
            self.release(rd.spec.remote)

    def _loaded(self, verb: str, spec: LoadSpec, nbytes: int, secs: float) -> None:
        """A load that completed (READ or push): counted, reported finished, logged."""
        secs = max(secs, 1e-9)
        s = self.stats
        s.reads += 1
        s.blocks_read += len(spec.local_block_ids)
        s.bytes_read += nbytes
        s.read_seconds.append(secs)
        s.read_bytes.append(nbytes)
        self._done_recving.add(spec.request_id)
        log.info("kvtransfer: %s %s: %d blocks, %d bytes in %.2f ms (%.2f GB/s)", verb, spec.request_id,
                 len(spec.local_block_ids), nbytes, secs * 1e3, nbytes / secs / 1e9)

    def _fail(self, spec: LoadSpec, why: str) -> None:
        self.stats.failures += 1
        self.stats.recomputes += 1
        self._failed_recving.add(spec.request_id)
        self._done_recving.add(spec.request_id)
        log.warning("kvtransfer: load of %s failed (%s); recomputing locally", spec.request_id, why)

    # -- io threads -----------------------------------------------------------------------
    def _prepare(self, spec: LoadSpec, queued_at: float) -> tuple[Peer, float | None]:
        """Handshake (cached per engine), compatibility, then acquire (pull) or push; the peer,
        and when the push the holder accepted was sent (None in pull mode)."""
        began = self.clock()
        faults.pause_before_read(self.fault_pause_s, self.sleep)  # test-only: hold a transfer here
        remote = spec.remote
        peer = self._handshake(remote)
        shook = self.clock()
        try:
            check_compatible(self.local, peer.metadata)
        except HandshakeError as exc:
            self._release_now(remote)  # nobody can read these blocks: free them at once
            raise TransferFailed(str(exc)) from exc
        # "pending" means the prefill engine has not yet run the step that takes its hold (its
        # blocks are already kept by vLLM's delayed free): worth waiting for, since a recompute
        # costs this engine a whole prefill that stalls its other streams. Up to half the load's
        # budget (the rest is left for the transfer), and never less than a handshake's timeout.
        deadline = max(self.clock() + self.handshake_timeout_s, queued_at + self.read_timeout_s / 2)
        push = pair_mode(spec.mode or self.mode, peer.metadata.transfer_modes) == "push"
        while True:
            if push:
                msg = Push(remote.request_id, self.engine_id, list(spec.local_block_ids), list(spec.remote_block_ids),
                           queued_at + self.read_timeout_s - self.clock(), self._auth)
            else:
                msg = Acquire(remote.request_id, self.engine_id, self._auth)
            sent = self.clock()
            try:
                with peer.lock:
                    reply = peer.client.call(msg)
            except HandshakeError as exc:  # holder unreachable: maybe restarted; handshake again next time
                self._forget_peer(remote.engine_id)
                raise TransferFailed(str(exc)) from exc
            if reply.status != "pending" or self.clock() >= deadline:
                took = self.clock() - began
                if took > SLOW_PREPARE_S:
                    log.warning("kvtransfer: acquire of %s took %.2f s (handshake %.2f s, answer %s, "
                                "queued %.2f s before it started)", remote.request_id, took, shook - began,
                                reply.status, began - queued_at)
            if reply.status == "ok":
                return peer, (sent if push else None)
            if reply.status == "pending" and self.clock() < deadline:
                self.sleep(ACQUIRE_PENDING_RETRY_S)
                continue
            if push and reply.status == "error":
                self._release_now(remote)  # the holder may still hold the blocks
                self._forget_peer(remote.engine_id)  # and may have forgotten this engine: handshake again
            raise TransferFailed(f"holder {remote.engine_id} answered {reply.status}: {reply.message}")

    def _handshake(self, remote: TransferParams) -> Peer:
        with self._peers_lock:
            peer = self._peers.get(remote.engine_id)
        if peer is not None:
            return peer
        client = SideChannelClient(remote.side_channel, self.handshake_timeout_s)
        try:
            # This engine's metadata always goes along: any request may ask for push (LoadSpec.mode).
            reply = client.call(Hello(PROTOCOL_VERSION, self.engine_id, self._auth, self.local))
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
        peer = Peer(md, client, pair_mode(self.mode, md.transfer_modes))
        with self._peers_lock:
            peer = self._peers.setdefault(remote.engine_id, peer)
        log.info("kvtransfer: handshake with engine %s at %s (compat %s, mode %s)", md.engine_id, remote.side_channel,
                 md.compat_hash(), peer.mode)
        return peer

    def _forget_peer(self, engine_id: str) -> None:
        with self._peers_lock:
            peer = self._peers.pop(engine_id, None)
            if peer is not None:
                self._stale_agents.append(peer.agent_name)
        if peer is not None:
            peer.client.close()

    def _release_now(self, remote: TransferParams) -> None:
        """Errors are only logged: the holder frees by lease anyway, nothing is stranded."""
        try:
            with self._peers_lock:
                peer = self._peers.get(remote.engine_id)
            if peer is not None:
                with peer.lock:
                    peer.client.call(Release(remote.request_id, self.engine_id, self._auth))
            else:
                client = SideChannelClient(remote.side_channel, self.handshake_timeout_s)
                try:
                    client.call(Release(remote.request_id, self.engine_id, self._auth))
                finally:
                    client.close()
            with self._peers_lock:
                self._releases_sent += 1
        except HandshakeError as exc:
            log.warning("kvtransfer: release of %s at %s failed: %s", remote.request_id, remote.engine_id, exc)
            self._forget_peer(remote.engine_id)
