"""Transport-aware conditional disaggregation (`router.split`): the online lines recover
what they are fed, the decision follows the estimates, and nothing measured means split."""

from __future__ import annotations

import math

import pytest

from router.split import MIN_SAMPLES, STALE_S, OnlineLine, SplitCosts, SplitEstimate, decide


def test_a_line_recovers_latency_and_bandwidth():
    line = OnlineLine()
    for nbytes in (1e6, 4e6, 16e6, 2e6, 8e6):
        line.add(nbytes, 0.002 + nbytes / 2e9)  # 2 ms per READ, 2 GB/s
    a, b = line.coefficients()
    assert a == pytest.approx(0.002) and 1 / b == pytest.approx(2e9)
    assert line.predict(100e6) == pytest.approx(0.052)


def test_sizes_all_alike_go_through_the_origin_and_noise_never_makes_a_negative_cost():
    same = OnlineLine()
    for _ in range(5):
        same.add(1000.0, 0.5)
    assert same.coefficients() == pytest.approx((0.0, 0.0005))
    falling = OnlineLine()
    for x, y in ((100.0, 0.3), (200.0, 0.2), (300.0, 0.1)):
        falling.add(x, y)
    a, b = falling.coefficients()
    assert b == 0 and a == pytest.approx(0.2, rel=0.02)  # the (decayed) mean
    assert OnlineLine().coefficients() == (0.0, 0.0) and not OnlineLine().ready


def test_older_samples_fade():
    line = OnlineLine()
    for i in range(200):
        line.add(float(1000 + i % 7), 0.001 * (1000 + i % 7))  # 1 ms per unit
    for i in range(200):
        line.add(float(1000 + i % 7), 0.004 * (1000 + i % 7))  # the link got 4x slower
    assert line.predict(1000) == pytest.approx(4.0, rel=0.05)


def test_decide():
    est = SplitEstimate(uncached_tokens=100, transfer_bytes=10, transfer_s=0.02, prefill_queue_s=0.01,
                        local_prefill_s=0.05)
    assert est.split_s == pytest.approx(0.03) and decide(est)[0] is True
    assert decide(SplitEstimate(uncached_tokens=100, transfer_bytes=10, transfer_s=0.04, prefill_queue_s=0.01,
                                local_prefill_s=0.05))[0] is False
    unknown = SplitEstimate(uncached_tokens=100, transfer_bytes=10, transfer_s=None, prefill_queue_s=None,
                            local_prefill_s=0.05)
    assert decide(unknown) == (True, "not measured yet: split (the default)")
    cached = SplitEstimate(uncached_tokens=0, transfer_bytes=0, transfer_s=0.0, prefill_queue_s=0.0,
                           local_prefill_s=None)
    assert decide(cached)[0] is False


def test_costs_use_the_workers_own_lines_then_the_pools():
    c = SplitCosts()
    e = c.estimate(uncached_tokens=500, transfer_bytes=10**6, prefill_worker="p0", decode_worker="d0",
                   queued_prefill_tokens=0)
    assert e.transfer_s is None and e.local_prefill_s is None and decide(e)[0]
    for i in range(MIN_SAMPLES):
        c.observe_transfer("p0", (i + 1) * 10**6, 0.001 + (i + 1) * 10**6 / 1e9)  # 1 GB/s, 1 ms
        c.observe_prefill("p0", (i + 1) * 100, 0.01 + (i + 1) * 100 * 1e-4)  # 10 ms + 0.1 ms/token
    e = c.estimate(uncached_tokens=500, transfer_bytes=10**7, prefill_worker="p0", decode_worker="d0",
                   queued_prefill_tokens=1000)
    # d0 never prefilled: it borrows the pool's line (p0's samples).
    assert e.transfer_s == pytest.approx(0.011) and e.local_prefill_s == pytest.approx(0.06)
    assert e.prefill_queue_s == pytest.approx(0.1)  # 1,000 queued tokens x 0.1 ms
    assert e.bandwidth_gbps == pytest.approx(1.0) and e.read_latency_s == pytest.approx(0.001)
    assert decide(e)[0] is False  # 11 ms + 100 ms of queue > 60 ms
    # d0's own (slower) prefills, once it has enough, are its line.
    for i in range(MIN_SAMPLES):
        c.observe_prefill("d0", (i + 1) * 100, 0.05 + (i + 1) * 100 * 1e-3)
    e = c.estimate(uncached_tokens=500, transfer_bytes=10**7, prefill_worker="p0", decode_worker="d0",
                   queued_prefill_tokens=0)
    assert e.local_prefill_s == pytest.approx(0.55) and decide(e)[0] is True
    # Nothing to move: the transfer costs nothing.
    assert c.estimate(uncached_tokens=0, transfer_bytes=0, prefill_worker="p9", decode_worker="d0",
                      queued_prefill_tokens=0).transfer_s == 0.0
    c.forget("d0")
    assert "d0" not in c.prefill and not math.isnan(c.prefill_pool.predict(1))


def test_bad_samples_are_ignored():
    c = SplitCosts()
    c.observe_transfer("p0", 0, 1.0)
    c.observe_prefill("p0", -5, 1.0)
    c.observe_prefill("p0", 5, -1.0)
    assert c.transfer_pool.n == 0 and c.prefill_pool.n == 0


def test_a_line_not_renewed_for_a_while_is_measured_again_and_gone_workers_are_pruned():
    now = [0.0]
    c = SplitCosts(clock=lambda: now[0])
    for i in range(MIN_SAMPLES):
        c.observe_transfer("p0", (i + 1) * 10**6, 1.0)  # a slow link: every request stays local...
        c.observe_prefill("p0", (i + 1) * 100, 0.01)
    est = dict(uncached_tokens=300, transfer_bytes=10**6, prefill_worker="p0", decode_worker="d0",
               queued_prefill_tokens=0)
    assert decide(c.estimate(**est))[0] is False
    now[0] = STALE_S + 1  # ...until its line is old: then one request splits, and measures it again
    e = c.estimate(**est)
    assert e.transfer_s is None and decide(e) == (True, "not measured yet: split (the default)")
    # A holder that does not say its block bytes: no transfer estimate (split), never a guess in blocks.
    now[0] = 0.0
    assert c.estimate(**{**est, "transfer_bytes": None}).transfer_s is None
    c.prune({"d0"})
    assert c.transfer == {} and c.prefill == {}
