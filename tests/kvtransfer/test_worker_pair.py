"""Two PdWorkers in this process with real NIXL and side channels, no vLLM engine, in each
transfer mode: a READ (pull) or a notified WRITE (push) moves exactly the planned blocks, the
holder is freed and reports the request sent, and a second load of the same (now freed)
request is answered "gone" and recomputed. Push-only: a WRITE that never completes is
cancelled by the holder, which tells the decode side at once; a decode side that hears
nothing gives up at its deadline, and only after the holder answered its release."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from kvtransfer.protocol import LoadSpec, TransferParams
from tests.helpers.procs import free_port

if TYPE_CHECKING:
    from kvtransfer.worker import PdWorker


def meta(**fields):
    # The connector's modules import vLLM and torch: imported when a test runs, not when
    # the unit tests are collected.
    from kvtransfer.scheduler import PdConnectorMetadata

    return PdConnectorMetadata(**fields)

NUM_BLOCKS, BLOCK = 16, 16


def make(engine_id: str, port: int, mode: str = "pull") -> tuple[PdWorker, dict]:
    import torch

    from kvtransfer.worker import PdWorker, WorkerConfig

    ep = f"tcp://127.0.0.1:{port}"
    cfg = WorkerConfig(engine_id=engine_id, bind_endpoint=ep, advertise_endpoint=ep, lease_seconds=10.0,
                       read_timeout_s=5.0, handshake_timeout_s=2.0, transport="shm", model="m", dtype="bfloat16",
                       kv_cache_dtype="bfloat16", block_size=BLOCK, tp_size=1, transfer_mode=mode)
    w = PdWorker(cfg, NUM_BLOCKS)
    kv = {f"layer.{i}": torch.zeros(NUM_BLOCKS, 2, BLOCK, 32, dtype=torch.bfloat16) for i in range(3)}
    w.register_kv_caches(kv)
    return w, kv


def steps_until(done, workers, timeout: float = 10.0) -> tuple[set, set, set]:
    sending, recving, failed = set(), set(), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w, finished in workers:
            s, r, f = w.get_transfer_results(finished)
            sending |= s
            recving |= r
            failed |= f
        if done(sending, recving, failed):
            break
        time.sleep(0.01)
    return sending, recving, failed


@pytest.fixture(params=["pull", "push"])
def mode(request) -> str:
    return request.param


@pytest.fixture
def pair(monkeypatch, mode):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    pport = free_port()
    p, pkv = make("eng-p", pport)  # a holder serves both modes whatever its own
    d, dkv = make("eng-d", free_port(), mode)
    try:
        yield p, pkv, d, dkv, f"tcp://127.0.0.1:{pport}"
    finally:
        d.shutdown()
        p.shutdown()


def test_read_moves_the_blocks_and_releases_the_holder(pair, mode):
    import torch

    p, pkv, d, dkv, side = pair
    for t in pkv.values():
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    p.start_load_kv(meta(holds={"r": (3, 10.0)}))
    remote = TransferParams(engine_id="eng-p", request_id="r", block_ids=[2, 3, 4], num_tokens=40,
                            side_channel=side, lease_seconds=10.0)
    d.start_load_kv(meta(loads=[LoadSpec("r", remote, [7, 8, 9], [2, 3, 4])]))
    sending, recving, failed = steps_until(lambda s, r, f: "r" in s and "r" in r, [(p, {"r"}), (d, set())])
    assert (sending, recving, failed) == ({"r"}, {"r"}, set())
    for src, dst in zip(pkv.values(), dkv.values()):
        assert torch.equal(src[2:5], dst[7:10])
        assert not dst[:7].any() and not dst[10:].any()  # nothing else written
    dr, pr = d.take_stats().reduce(), p.take_stats().reduce()
    block_bytes = 3 * 2 * BLOCK * 32 * 2  # layers x (heads x block x 2*head) bf16
    assert (dr["reads"], dr["blocks_read"], dr["bytes_read"], dr["failures"]) == (1, 3, 3 * block_bytes, 0)
    assert dr["releases_sent"] == (1 if mode == "pull" else 0) and dr["gbps"] > 0  # a pusher frees itself
    assert (pr["requests_held"], pr["blocks_released"], pr["held_blocks"], pr["lease_expiries"]) == (1, 3, 0, 0)
    assert (pr["pushes"], pr["blocks_pushed"], pr["bytes_pushed"]) == ((0, 0, 0) if mode == "pull" else
                                                                       (1, 3, 3 * block_bytes))
    assert d.reader._peers["eng-p"].mode == mode

    # One load may ask for the other mode (the benchmark compares both on one pair).
    other = "pull" if mode == "push" else "push"
    p.start_load_kv(meta(holds={"r2": (2, 10.0)}))
    remote2 = TransferParams(engine_id="eng-p", request_id="r2", block_ids=[5, 6], num_tokens=20,
                             side_channel=side, lease_seconds=10.0)
    d.start_load_kv(meta(loads=[LoadSpec("r2", remote2, [11, 12], [5, 6], other)]))
    sending, recving, failed = steps_until(lambda s, r, f: "r2" in s and "r2" in r, [(p, {"r2"}), (d, set())])
    assert (sending, recving, failed) == ({"r2"}, {"r2"}, set())
    for src, dst in zip(pkv.values(), dkv.values()):
        assert torch.equal(src[5:7], dst[11:13])
    dr, pr = d.take_stats().reduce(), p.take_stats().reduce()
    assert (pr["pushes"], dr["releases_sent"]) == ((1, 0) if other == "push" else (0, 1))

    # The first request again: its blocks are freed, the holder says "gone", the load recomputes.
    d.start_load_kv(meta(loads=[LoadSpec("r", remote, [1], [2])]))
    _, recving, failed = steps_until(lambda s, r, f: "r" in f, [(d, set())])
    assert failed == {"r"} and recving == {"r"}
    assert d.take_stats().reduce()["recomputes"] == 1


class StuckWrites:
    """The holder's agent with WRITEs that never complete (a stalled link): posted for real,
    reported in progress, cancelled on release; optionally the failure notice is lost too."""

    def __init__(self, agent, deliver_failure: bool) -> None:
        self.agent, self.deliver_failure = agent, deliver_failure
        self.cancelled: list[object] = []

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def post_write(self, remote_agent, remote_layout, local, remote, notif):
        return self.agent.post_write(remote_agent, remote_layout, local, remote, b"stalled")  # never lands, as seen

    def check(self, handle):
        return "PROC"

    def release(self, handle):
        self.cancelled.append(handle)

    def send_notif(self, remote_agent, msg):
        if self.deliver_failure:
            self.agent.send_notif(remote_agent, msg)


@pytest.mark.parametrize("mode", ["push"])
@pytest.mark.parametrize("deliver_failure", [True, False])
def test_a_stalled_push_is_cancelled_and_recomputed_without_stranding_blocks(pair, deliver_failure, monkeypatch):
    import kvtransfer.pusher as pusher

    p, _, d, _, side = pair
    monkeypatch.setattr(pusher, "DEADLINE_MARGIN_S", 0.5)
    d.reader.read_timeout_s = 2.0  # decode deadline 2 s; the holder gives up 0.5 s before it
    stuck = StuckWrites(p.agent, deliver_failure)
    p.holder.agent = stuck
    p.start_load_kv(meta(holds={"r": (2, 10.0)}))
    remote = TransferParams(engine_id="eng-p", request_id="r", block_ids=[2, 3], num_tokens=20,
                            side_channel=side, lease_seconds=10.0)
    d.start_load_kv(meta(loads=[LoadSpec("r", remote, [7, 8], [2, 3])]))
    sending, recving, failed = steps_until(lambda s, r, f: "r" in f and "r" in s, [(p, {"r"}), (d, set())])
    assert failed == {"r"} and recving == {"r"} and sending == {"r"}  # recomputed; the holder's blocks freed
    assert stuck.cancelled  # the WRITE was cancelled, not left running
    pr, dr = p.take_stats().reduce(), d.take_stats().reduce()
    assert (pr["push_failures"], pr["held_blocks"], dr["recomputes"]) == (1, 0, 1)
    # Told by the holder before its own deadline ran out (no release needed), or else released at it.
    assert dr["releases_sent"] == (0 if deliver_failure else 1)


@pytest.mark.parametrize("mode", ["push"])
def test_a_hold_released_by_another_engine_ends_the_push_at_once(pair):
    """The frontend frees the hold of a client that left (`/kv/release` on the prefill worker)
    while the WRITE is in flight: the WRITE is cancelled and the decode engine told, so its
    blocks go back now, not at its (here 30 s) deadline, and it sends no release of its own."""
    from kvtransfer.side_channel import release_once

    p, _, d, _, side = pair
    d.reader.read_timeout_s = 30.0
    stuck = StuckWrites(p.agent, deliver_failure=True)
    p.holder.agent = stuck
    p.start_load_kv(meta(holds={"r": (2, 10.0)}))
    remote = TransferParams(engine_id="eng-p", request_id="r", block_ids=[2, 3], num_tokens=20,
                            side_channel=side, lease_seconds=10.0)
    d.start_load_kv(meta(loads=[LoadSpec("r", remote, [7, 8], [2, 3])]))
    steps_until(lambda s, r, f: bool(p.holder.pusher.busy()), [(p, {"r"}), (d, set())], timeout=5)
    assert p.holder.pusher.busy()  # the WRITE is in flight
    assert release_once(side, "r", "prefill-worker-frontend-release", None, 2.0).status == "ok"
    sending, recving, failed = steps_until(lambda s, r, f: "r" in f and "r" in s, [(p, {"r"}), (d, set())])
    assert failed == {"r"} and recving == {"r"} and sending == {"r"} and stuck.cancelled
    dr = d.take_stats().reduce()
    assert (dr["recomputes"], dr["releases_sent"]) == (1, 0)
