"""The reader's acquire (pull) or push, and failure accounting, with a stand-in holder: no
sockets, no NIXL. Each test runs in both transfer modes.

A load that cannot be read (holder says "gone", an incompatible holder, an acquire or push
still "pending" after half its budget) fails: it is reported finished and failed (vLLM
then recomputes it) and counted in `failures` and `recomputes`."""

from __future__ import annotations

import pytest

from kvtransfer.errors import TransferFailed
from kvtransfer.protocol import Acquire, Push, Release, Reply, TransferParams
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
        assert isinstance(msg, Acquire | Push)
        status = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return Reply(status, "lease expired" if status == "gone" else "")

    def close(self) -> None:
        pass


def spec(rid: str = "r1") -> LoadSpec:
    remote = TransferParams(engine_id="p", request_id=rid, block_ids=[1, 2], num_tokens=200,
                            side_channel="tcp://127.0.0.1:1", lease_seconds=30.0)
    return LoadSpec(rid, remote, [7, 8], [1, 2])


@pytest.fixture(params=["pull", "push"])
def mode(request) -> str:
    return request.param


def make_reader(holder: Holder, clock: Clock, remote_md=None, mode: str = "pull") -> Reader:
    r = Reader("d", read_timeout_s=5.0, handshake_timeout_s=2.0, clock=clock, sleep=clock.sleep, mode=mode)
    r.local = md(engine_id="d")
    remote_md = remote_md or md(engine_id="p", transfer_modes=("pull", "push"))
    r._peers["p"] = Peer(remote_md, holder, mode)  # as after a handshake (a socket)
    return r


def kind(mode: str) -> type:
    return Acquire if mode == "pull" else Push


def run_load(r: Reader, s: LoadSpec) -> None:
    r.load(s)
    r._preparing[s.request_id].future.exception(timeout=10)  # io thread done
    r.start_prepared()


def test_gone_answer_fails_the_load_and_counts_a_recompute(mode):
    holder = Holder(["gone"])
    r = make_reader(holder, Clock(), mode=mode)
    run_load(r, spec())
    assert r.take_finished() == ({"r1"}, {"r1"})
    assert (r.stats.failures, r.stats.recomputes, r.stats.reads) == (1, 1, 0)
    assert r.take_finished() == (set(), set())  # reported once
    r.close()


def test_pending_is_retried_until_ok(mode):
    holder = Holder(["pending", "pending", "ok"])
    clock = Clock()
    r = make_reader(holder, clock, mode=mode)
    peer, pushed_at = r._prepare(spec(), clock())
    assert peer.metadata.engine_id == "p"
    assert [type(m) for m in holder.calls] == [kind(mode)] * 3
    assert (pushed_at is None) == (mode == "pull")
    if mode == "push":
        # Where the blocks go, and a budget that shrinks with the retries (5 s read timeout).
        first, last = holder.calls[0], holder.calls[-1]
        assert (last.block_ids, last.holder_block_ids, last.request_id) == ([7, 8], [1, 2], "r1")
        from kvtransfer.reader import ACQUIRE_PENDING_RETRY_S

        assert first.budget_s == pytest.approx(5.0) and last.budget_s == pytest.approx(5.0 - 2 * ACQUIRE_PENDING_RETRY_S)
    r.close()


@pytest.mark.parametrize("queued_ago, waits", [(0.0, 2.5), (4.0, 2.0)])
def test_pending_fails_after_half_the_loads_budget_or_at_least_a_handshake_timeout(mode, queued_ago, waits):
    """A load queued just now waits, in virtual time, for half the 5-s read timeout (longer than
    the 2-s handshake timeout); one queued 4 s ago, half its budget spent, still waits a
    handshake timeout. No longer in either case."""
    holder = Holder(["pending"])
    clock = Clock()
    r = make_reader(holder, clock, mode=mode)
    with pytest.raises(TransferFailed, match="answered pending"):
        r._prepare(spec(), clock() - queued_ago)
    assert 50.0 + waits <= clock.t < 50.0 + waits + 0.1
    r.close()


def test_incompatible_holder_is_released_at_once_and_recomputed(mode):
    holder = Holder(["ok"])
    r = make_reader(holder, Clock(), remote_md=md(engine_id="p", kv_cache_dtype="fp8", transfer_modes=("pull", "push")),
                    mode=mode)
    run_load(r, spec())
    assert r.take_finished() == ({"r1"}, {"r1"})
    assert [type(m) for m in holder.calls] == [Release]  # never acquired nor pushed
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


def test_push_error_releases_and_forgets_the_holder():
    """A holder that refuses a push (it lost this engine's metadata, a WRITE that could not
    start) may still hold the blocks: they are released, and the next load handshakes again."""
    holder = Holder(["error"])
    r = make_reader(holder, Clock(), mode="push")
    run_load(r, spec())
    r._io.shutdown(wait=True)
    assert r.take_finished() == ({"r1"}, {"r1"})
    assert [type(m) for m in holder.calls] == [Push, Release]
    assert "p" not in r._peers
    r.close()


class Notifier:
    """The engine's NIXL agent as the push path sees it: notifications only."""

    def __init__(self) -> None:
        self.inbox: list[bytes] = []

    def take_notifs(self) -> list[bytes]:
        out, self.inbox = self.inbox, []
        return out


def test_push_completes_on_its_notification_and_fails_on_the_failed_one():
    from kvtransfer.protocol import FAILED_SUFFIX, notif_tag

    holder, clock = Holder(["ok"]), Clock()
    r = make_reader(holder, clock, mode="push")
    agent = Notifier()
    run_load(r, spec("a"))
    run_load(r, spec("b"))
    agent.inbox = [b"pdserve-kv:unknown", notif_tag("a")]
    clock.t += 0.5
    r._poll_pushes(agent)
    agent.inbox = [notif_tag("b") + FAILED_SUFFIX]
    r._poll_pushes(agent)
    assert r.take_finished() == ({"a", "b"}, {"b"})
    s = r.stats
    assert (s.reads, s.blocks_read, s.failures, s.recomputes) == (1, 2, 1, 1)
    assert s.read_seconds == [pytest.approx(0.5)] and s.bytes_read == 2 * r.local.layout.bytes_per_block
    assert [type(m) for m in holder.calls] == [Push, Push]  # the holder frees its blocks itself
    r.close()


def test_push_past_its_deadline_fails_only_after_the_holder_answered_the_release():
    from kvtransfer.protocol import notif_tag

    holder, clock = Holder(["ok"]), Clock()
    r = make_reader(holder, clock, mode="push")
    agent = Notifier()
    run_load(r, spec())
    clock.t += 5.0  # the read timeout, counted from before the push
    r._poll_pushes(agent)
    r._cancels["r1"][1].result(timeout=10)  # the release went out and was answered
    agent.inbox = [notif_tag("r1")]  # a completion seen after giving up is not used
    r._poll_pushes(agent)
    assert r.take_finished() == ({"r1"}, {"r1"})
    assert [type(m) for m in holder.calls] == [Push, Release]
    assert (r.stats.reads, r.stats.failures) == (0, 1)
    r.close()


def test_a_request_may_ask_for_the_other_mode_and_an_older_holder_is_pulled_from():
    from dataclasses import replace

    holder, clock = Holder(["ok"]), Clock()
    r = make_reader(holder, clock, mode="push")
    r._prepare(replace(spec(), mode="pull"), clock())
    r._prepare(spec(), clock())
    assert [type(m) for m in holder.calls] == [Acquire, Push]
    old = Holder(["ok"])
    r._peers["p"] = Peer(md(engine_id="p"), old, "pull")  # serves pull only (no transfer_modes sent)
    r._prepare(spec(), clock())
    assert [type(m) for m in old.calls] == [Acquire]
    r.close()


def test_a_notification_before_its_push_is_registered_is_kept_for_it():
    """The holder's WRITE can finish before its "ok" reaches the engine thread: a notification
    taken in for another push's poll waits for its own push instead of being dropped."""
    from kvtransfer.protocol import notif_tag

    holder, clock = Holder(["ok"]), Clock()
    r = make_reader(holder, clock, mode="push")
    agent = Notifier()
    run_load(r, spec("a"))
    agent.inbox = [notif_tag("b")]  # b's WRITE is done; b is still on its way to the engine thread
    r._poll_pushes(agent)
    assert r.take_finished() == (set(), set())
    r.agent = agent  # as once KV caches are registered
    run_load(r, spec("b"))
    assert r.take_finished() == ({"b"}, set())
    clock.t += 6.0  # a's deadline: released, then failed; stale early notifications expire
    agent.inbox = [notif_tag("gone-long-ago")]
    r._poll_pushes(agent)
    r._cancels["a"][1].result(timeout=10)
    clock.t += 6.0
    r._poll_pushes(agent)
    assert r.take_finished() == ({"a"}, {"a"}) and r._early == {}
    r.close()


def test_a_push_completes_on_its_notification_while_its_io_thread_still_waits_for_the_ok():
    """A busy process can run the io thread tens of milliseconds late: the notification alone
    proves the holder accepted the push and the bytes landed, so the engine thread's next
    step completes the load without waiting for the "ok"."""
    import threading

    from kvtransfer.protocol import FAILED_SUFFIX, notif_tag

    answered = threading.Event()

    class SlowHolder(Holder):
        def call(self, msg):
            reply = super().call(msg)
            answered.wait(timeout=10)  # the reply is on its way
            return reply

    holder, clock = SlowHolder(["ok"]), Clock()
    r = make_reader(holder, clock, mode="push")
    agent = Notifier()
    r.agent = agent
    r.load(spec("a"))
    r.load(spec("b"))
    agent.inbox = [notif_tag("a"), notif_tag("b") + FAILED_SUFFIX]
    r.step()  # the engine thread's poll, with both io threads still waiting
    assert r.take_finished() == ({"a", "b"}, {"b"}) and r._preparing == {}
    answered.set()  # the late "ok"s are not used again
    r.step()
    assert r.take_finished() == (set(), set())
    assert (r.stats.reads, r.stats.failures) == (1, 1)
    r.close()


def test_a_push_accepted_early_while_an_earlier_one_registers_is_started_once():
    """Two pushes answered "ok" in the same step: registering the first polls notifications,
    and the second's, already here, completes it there. The same step must then not start it
    again (this crashed the decode engine with a KeyError in the disconnect test)."""
    from kvtransfer.protocol import notif_tag

    holder, clock = Holder(["ok"]), Clock()
    r = make_reader(holder, clock, mode="push")
    agent = Notifier()
    r.agent = agent
    for rid in ("a", "b"):
        r.load(spec(rid))
        r._preparing[rid].future.exception(timeout=10)  # its "ok" is in
    agent.inbox = [notif_tag("b")]
    r.step()
    assert r.take_finished() == ({"b"}, set()) and r._preparing == {} and list(r._pushes) == [notif_tag("a")]
    agent.inbox = [notif_tag("a")]
    r.step()
    assert r.take_finished() == ({"a"}, set()) and r._pushes == {}
    assert (r.stats.reads, r.stats.failures) == (2, 0)
    r.close()


def test_an_idle_step_waits_for_an_answer_instead_of_spinning():
    """A step that computes nothing blocks (up to its timeout) until a pending load's acquire or
    push is answered; with nothing pending, or a load already finished, it returns at once."""
    import threading

    answer = threading.Event()

    class SlowHolder(Holder):
        def call(self, msg):
            answer.wait(timeout=10)
            return super().call(msg)

    r = make_reader(SlowHolder(["ok"]), Clock(), mode="push")
    assert r.idle_wait(10.0) is False  # nothing pending
    r.load(spec("a"))
    assert r.idle_wait(0.01) is False  # not answered: the timeout
    threading.Timer(0.05, answer.set).start()
    assert r.idle_wait(10.0) is True and r._preparing["a"].future.done()
    r._done_recving.add("x")
    assert r.idle_wait(10.0) is False  # a load to report: no waiting
    r.close()


def test_a_notification_wakes_an_idle_step():
    """The holder's progress thread takes in a push's notification: that wakes the engine
    thread's idle wait."""
    import threading

    from kvtransfer.nixl_agent import NixlAgent

    class Nixl:  # nixl's agent, as far as progress() calls it
        def __init__(self) -> None:
            self.notifs: dict[str, list[bytes]] = {}

        def get_new_notifs(self) -> dict[str, list[bytes]]:
            out, self.notifs = self.notifs, {}
            return out

    r = make_reader(Holder(["ok"]), Clock(), mode="push")
    agent = NixlAgent.__new__(NixlAgent)  # no NIXL here: its inbox only
    agent._agent, agent._inbox, agent._inbox_lock, agent.on_notifs = Nixl(), [], threading.Lock(), None
    r.attach(agent, r.local)
    r._pushes[b"t"] = object()  # a push awaited
    agent.progress()
    assert r.idle_wait(0.01) is False  # nothing arrived
    agent._agent.notifs = {"p": [b"t"]}
    agent.progress()
    assert r.idle_wait(10.0) is True and agent.take_notifs() == [b"t"]
    r.close()
