"""The reader's acquire and failure accounting with a stand-in holder: no sockets, no NIXL.

A load that cannot be read (holder says "gone", an incompatible holder, an acquire still
"pending" at the handshake deadline) fails: it is reported finished and failed (vLLM then
recomputes it) and counted in `failures` and `recomputes`."""

from __future__ import annotations

import pytest

from kvtransfer.errors import TransferFailed
from kvtransfer.protocol import Acquire, Release, Reply, TransferParams
from kvtransfer.reader import Peer, Reader
from kvtransfer.protocol import LoadSpec
from tests.kvtransfer.test_protocol import md


class Clock:
    """Virtual time, advanced only by the reader's own sleeps."""

    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class Holder:
    """Answers the reader's side-channel calls like a holder engine would."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.calls: list[object] = []

    def call(self, msg):
        self.calls.append(msg)
        if isinstance(msg, Release):
            return Reply("ok")
        assert isinstance(msg, Acquire)
        status = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return Reply(status, "lease expired" if status == "gone" else "")

    def close(self) -> None:
        pass


def spec(rid: str = "r1") -> LoadSpec:
    remote = TransferParams(engine_id="p", request_id=rid, block_ids=[1, 2], num_tokens=200,
                            side_channel="tcp://127.0.0.1:1", lease_seconds=30.0)
    return LoadSpec(rid, remote, [7, 8], [1, 2])


def make_reader(holder: Holder, clock: Clock, remote_md=None) -> Reader:
    r = Reader("d", read_timeout_s=5.0, handshake_timeout_s=2.0, clock=clock, sleep=clock.sleep)
    r.local = md(engine_id="d")
    r._peers["p"] = Peer(remote_md or md(engine_id="p"), holder)  # as after a handshake (a socket)
    return r


def run_load(r: Reader, s: LoadSpec) -> None:
    r.load(s)
    r._preparing[s.request_id].future.exception(timeout=10)  # io thread done
    r.start_prepared()


def test_gone_answer_fails_the_load_and_counts_a_recompute():
    holder = Holder(["gone"])
    r = make_reader(holder, Clock())
    run_load(r, spec())
    assert r.take_finished() == ({"r1"}, {"r1"})
    assert (r.stats.failures, r.stats.recomputes, r.stats.reads) == (1, 1, 0)
    assert r.take_finished() == (set(), set())  # reported once
    r.close()


def test_pending_is_retried_until_ok():
    holder = Holder(["pending", "pending", "ok"])
    clock = Clock()
    r = make_reader(holder, clock)
    peer = r._prepare(spec(), clock())
    assert peer.metadata.engine_id == "p"
    assert [type(m) for m in holder.calls] == [Acquire, Acquire, Acquire]
    r.close()


def test_pending_past_the_handshake_deadline_fails():
    holder = Holder(["pending"])
    clock = Clock()
    r = make_reader(holder, clock)
    with pytest.raises(TransferFailed, match="answered pending"):
        r._prepare(spec(), clock())
    assert clock.t >= 50.0 + 2.0  # waited out the handshake timeout, in virtual time
    r.close()


def test_incompatible_holder_is_released_at_once_and_recomputed():
    holder = Holder(["ok"])
    r = make_reader(holder, Clock(), remote_md=md(engine_id="p", kv_cache_dtype="fp8"))
    run_load(r, spec())
    assert r.take_finished() == ({"r1"}, {"r1"})
    assert [type(m) for m in holder.calls] == [Release]  # never acquired
    assert (r.stats.failures, r.stats.recomputes, r.stats.releases_sent) == (1, 1, 1)
    r.close()


def test_load_before_kv_registration_fails_and_releases():
    """The READ cannot be posted without an agent: the engine survives, the load recomputes."""
    holder = Holder(["ok"])
    r = make_reader(holder, Clock())
    run_load(r, spec())
    r._io.shutdown(wait=True)  # the release goes out on an io thread
    assert r.take_finished() == ({"r1"}, {"r1"})
    assert [type(m) for m in holder.calls] == [Acquire, Release]
    assert (r.stats.failures, r.stats.recomputes) == (1, 1)
    r.close()
