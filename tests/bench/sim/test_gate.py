"""The offline simulator's prefill gate and its decode choice as the prefill ends: the
frontend's own rules (serve.frontend.prefillgate.room, Routing.decode_for) on the virtual clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench.sim.cluster import OfflineCluster
from bench.sim.flow import Flow, Link
from bench.sim.gate import OfflineGate
from bench.sim.loop import Loop
from router.load import LoadTracker
from serve.frontend.settings import FrontendSettings
from serve.sim.engine import SimConfig
from serve.sim.timing import LinearStep


@dataclass(frozen=True)
class W:
    url: str


@dataclass(frozen=True)
class Plan:
    prefill: W | None
    prompt_blocks: int = 1


def _gate(workers, cap=1, timeout_s=10.0):
    loop, load = Loop(), LoadTracker()
    return OfflineGate(cap, load, lambda: workers, loop, timeout_s), loop, load


def test_waiters_get_the_router_s_choice_or_the_least_loaded_with_room_oldest_first():
    a, b = W("a"), W("b")
    gate, loop, load = _gate([a, b])
    got: list[tuple[str, str]] = []

    def admit(name, prefer):
        def granted(plan):
            load.acquire(plan.prefill.url, "prefill", 1)
            got.append((name, plan.prefill.url))
        gate.admit(Plan(prefer), granted, lambda: got.append((name, "timeout")))

    admit("r1", a)
    admit("r2", a)  # a is full: b has room
    admit("r3", a)
    admit("r4", b)
    assert got == [("r1", "a"), ("r2", "b")] and gate.held == 2
    load.release("b", "prefill", 1)
    gate.kick()  # b has room: the oldest waiter takes it, though it asked for a
    assert got[2:] == [("r3", "b")] and gate.held == 1
    load.release("a", "prefill", 1)
    gate.kick()
    assert got[3:] == [("r4", "a")] and gate.held == 0
    loop.run()  # the expiry timer finds nobody left
    assert len(got) == 4 and gate.timeouts == 0


def test_a_joining_worker_takes_waiters_and_the_rest_time_out_in_order():
    workers = [W("a")]
    gate, loop, load = _gate(workers, timeout_s=5.0)
    got: list[tuple[str, str, float]] = []
    for i in range(4):
        def granted(plan, i=i):
            load.acquire(plan.prefill.url, "prefill", 1)
            got.append((f"r{i}", plan.prefill.url, loop.now))
        loop.at(i * 1.0, gate.admit, Plan(W("a")), granted, lambda i=i: got.append((f"r{i}", "timeout", loop.now)))
    loop.at(1.5, lambda: (workers.append(W("b")), gate.kick()))
    loop.run()
    assert got == [("r0", "a", 0.0), ("r1", "b", 1.5), ("r2", "timeout", 7.0), ("r3", "timeout", 8.0)]
    assert gate.held == 0 and gate.timeouts == 2


def test_a_gate_needs_a_positive_cap():
    with pytest.raises(ValueError, match="cap >= 1"):
        OfflineGate(0, LoadTracker(), lambda: [], Loop(), 1.0)


STEP = LinearStep(0.001, 1e-3, 1e-4, 0)  # a 2,000-token prompt: about 2 s of prefill


def _cluster(roles, **settings):
    loop = Loop()
    s = FrontendSettings(model="sim", served_model_name="sim", block_size=16, **settings)
    cfg = SimConfig(max_num_seqs=8, num_blocks=4000, block_size=16, max_num_batched_tokens=2048)
    return OfflineCluster(loop, s, roles, cfg, STEP, 16 * 1024, Link(10.0, 0.001)), loop


def _burst(cluster, n=8, isl=2000, osl=4) -> list[Flow]:
    done: list[Flow] = []
    for i in range(n):
        cluster.submit(Flow(f"r{i}", i, 0, [10_000 * (i + 1) + t for t in range(isl)], osl, i, 0.0, done.append))
    return done


@pytest.mark.parametrize("cap", [1, 0])
def test_a_prefill_worker_that_joins_takes_part_of_a_backlog_only_with_the_gate(cap):
    """A burst on one prefill worker, a second joins 1 s later: with the gate the backlog waits
    in the frontend and the new worker takes part of it; without, it stays where it landed."""
    cluster, loop = _cluster(["prefill", "decode"], max_prefills_per_worker=cap, prefill_timeout_s=1000.0)
    done = _burst(cluster)
    new = "http://sim-prefill-9:8100"
    loop.at(1.0, cluster.add_worker, new, "prefill", STEP)
    loop.run()
    assert len(done) == 8 and all(f.error is None and len(f.times) == 4 for f in done)
    assert {f.path for f in done} == {"disagg"}
    on_new = sum(1 for f in done if f.prefill is not None and f.prefill.url == new)
    if cap:
        assert on_new >= 3 and cluster.gate is not None and cluster.gate.held == 0
    else:
        assert on_new == 0
    assert all(w.table.used_blocks == 0 for w in cluster.workers.values() if w.role == "prefill")


def test_a_request_that_waits_past_the_prefill_timeout_is_prefilled_by_its_decode_worker():
    """Three 2-s prefills, one at a time, within a 2.5-s budget that the gate's wait counts
    toward: the first ends in time; the second, sent at 2 s, is given up at 2.5 s; the third
    never leaves the gate. The decode worker prefills both."""
    cluster, loop = _cluster(["prefill", "decode"], max_prefills_per_worker=1, prefill_timeout_s=2.5)
    done = _burst(cluster, n=3)
    loop.run()
    assert {f.request_id: f.path for f in done} == {"r0": "disagg", "r1": "fallback", "r2": "fallback"}
    assert all(f.error is None and len(f.times) == 4 for f in done)
    assert cluster.gate is not None and cluster.gate.timeouts == 1 and cluster.gate.held == 0
    assert cluster.prefill_timeouts == 1
    assert all(w.table.used_blocks == 0 for w in cluster.workers.values() if w.role == "prefill")


def test_a_split_request_s_decode_worker_is_chosen_as_its_prefill_ends():
    """At arrival there is one decode worker; a second joins during the prefills: the hand-offs,
    chosen by the load then, use it too. The prefills end 2 s apart and each decode lasts about
    2.7 s, so only the first hand-off is a tie (broken at random); each later one finds one
    worker busy and takes the other: two each."""
    cluster, loop = _cluster(["prefill", "decode"])
    done = _burst(cluster, n=4, osl=2500)
    new = "http://sim-decode-9:8100"
    loop.at(0.5, cluster.add_worker, new, "decode", STEP)
    loop.run()
    assert len(done) == 4 and all(f.error is None and len(f.times) == 2500 for f in done)
    assert sum(1 for f in done if f.decode is not None and f.decode.url == new) == 2


def test_the_autoscaler_counts_requests_held_in_the_gate_as_the_prefill_pool_s_backlog():
    from bench.sim.scaling import SimScaler
    from serve.autoscale.decide import Bounds, Controller, Policy, Targets
    from serve.autoscale.model import Engine

    cluster, loop = _cluster(["prefill", "decode"], max_prefills_per_worker=1, prefill_timeout_s=1000.0)
    eng = Engine(STEP, 8, 2048)
    scaler = SimScaler(Controller(Policy("disagg", Targets(2.0, 0.06, 90.0), Bounds()),
                                  {"prefill": eng, "decode": eng}), STEP)
    done = _burst(cluster, n=5)
    scaler.attach(loop, cluster, done, 5)
    pools = scaler.pools()
    assert cluster.gate is not None and cluster.gate.held == 4
    assert pools["prefill"].ready == 1 and pools["prefill"].waiting == 4  # one prefilling, four held


def test_a_prefill_still_running_at_the_prefill_timeout_is_given_up_and_its_decode_worker_prefills():
    """As the frontend's --prefill-timeout: three 2-s prefills queued on one worker with a
    3-s budget; the first ends in time, the others are aborted on the prefill worker (their
    blocks freed, their load released) and prefilled by the decode worker."""
    cluster, loop = _cluster(["prefill", "decode"], prefill_timeout_s=3.0)
    done = _burst(cluster, n=3)
    loop.run()
    assert all(f.error is None and len(f.times) == 4 for f in done)
    assert sorted(f.path for f in done) == ["disagg", "fallback", "fallback"]
    assert cluster.prefill_timeouts == 2
    pw = next(w for w in cluster.workers.values() if w.role == "prefill")
    assert pw.table.used_blocks == 0 and not pw.engine.requests
    assert cluster.routing.load.requests(pw.url, "prefill") == 0
    # the fallbacks' first tokens came after the budget, from the decode worker's own prefill
    late = [f for f in done if f.path == "fallback"]
    assert all(f.times[0] > 3.0 for f in late)


def test_a_request_given_up_in_the_gate_goes_to_the_decode_worker_with_room_then():
    """The gate's timeout, like a prefill's end, chooses the decode worker by the load then: the
    only decode worker at arrival is loaded (by another frontend, say), and one that joined
    while the requests waited takes them all."""
    cluster, loop = _cluster(["prefill", "decode"], max_prefills_per_worker=1, prefill_timeout_s=2.5)
    busy = next(w for w in cluster.workers.values() if w.role == "decode")
    cluster.routing.load.acquire(busy.url, "decode", 1000)
    done = _burst(cluster, n=3, osl=40)
    new = "http://sim-decode-9:8100"
    loop.at(1.0, cluster.add_worker, new, "decode", STEP)
    loop.run()
    assert {f.request_id: f.path for f in done} == {"r0": "disagg", "r1": "fallback", "r2": "fallback"}
    assert all(f.error is None and len(f.times) == 40 for f in done)
    assert {f.request_id: f.decode.url for f in done if f.decode is not None} == {"r0": new, "r1": new, "r2": new}
