"""The SLA autoscaler's pure parts: its queueing model, its trend, and its decisions
(bounded steps, hysteresis, the 10-minute reversal guard, the worker cap, explanations)."""

from __future__ import annotations

import math
import random

import pytest

from serve.autoscale.decide import Bounds, Controller, Policy, Targets
from serve.autoscale.model import (INF, Engine, Load, erlang_c, predict_agg, predict_disagg, quantile, queue_wait,
                                   wait_law, wait_plus_service, z_of)
from serve.autoscale.observe import Observation, Pool, Trend
from serve.sim.timing import LinearStep

STEP = LinearStep(base_s=0.01, prefill_token_s=5e-5, decode_seq_s=2e-4, context_token_s=1e-7)
ENGINE = Engine(STEP, max_num_seqs=64)
LOAD = Load(10.0, [2000] * 50, [200] * 50)


def test_queueing_pieces():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = utilisation
    assert erlang_c(4, 4.0) == 1.0 and erlang_c(8, 1.0) < 1e-3
    assert queue_wait(1, 0.0, [0.1], 90) == 0.0
    assert queue_wait(2, 25.0, [0.1], 90) == INF  # offered 2.5 > 2 servers
    assert 0 < queue_wait(1, 8.0, [0.1], 90) < queue_wait(1, 9.0, [0.1], 90)
    assert quantile([1, 2, 3, 4], 50) == 2.5 and quantile([5], 90) == 5
    assert z_of(90) == pytest.approx(1.2816, abs=1e-3) and z_of(50) == pytest.approx(0.0, abs=1e-6)


def test_ttft_is_the_percentile_of_wait_plus_service_not_the_sum_of_percentiles():
    rng = random.Random(3)
    service = [0.3 * rng.uniform(0.8, 1.2) for _ in range(500)]
    pw, drain = wait_law(6, 19.0, service)
    # Monte Carlo of the same law: no wait with 1 - P(wait), else an exponential wait; plus a service draw.
    xs = sorted((rng.expovariate(drain) if rng.random() < pw else 0.0) + rng.choice(service) for _ in range(100_000))
    exact = wait_plus_service(6, 19.0, service, 90)
    assert exact == pytest.approx(xs[90_000], rel=0.02)
    assert quantile(service, 90) < exact < queue_wait(6, 19.0, service, 90) + quantile(service, 90)
    assert wait_plus_service(6, 0.0, service, 90) == pytest.approx(quantile(service, 90))  # nobody waits
    assert wait_plus_service(1, 10.0, service, 90) == INF  # offered 3 > 1 server


def test_more_prefill_workers_cut_ttft_and_more_decode_workers_cut_itl():
    one = predict_disagg(ENGINE, ENGINE, 1, 1, LOAD, 90)
    assert one.ttft_s == INF  # 10 req/s x 0.11 s a prompt: one prefill worker is past saturation
    p = [predict_disagg(ENGINE, ENGINE, n, 8, LOAD, 90).ttft_s for n in (2, 3, 4, 8)]
    assert p == sorted(p, reverse=True) and p[-1] < INF
    d = [predict_disagg(ENGINE, ENGINE, 8, n, LOAD, 90).itl_s for n in (2, 4, 8)]
    assert d == sorted(d, reverse=True)
    assert predict_disagg(ENGINE, ENGINE, 8, 1, LOAD, 90).itl_s == INF  # 10 req/s x ~200 steps > 64 slots
    a = [predict_agg(ENGINE, n, LOAD, 90) for n in (2, 4, 8)]
    assert [x.ttft_s for x in a] == sorted((x.ttft_s for x in a), reverse=True)
    assert all(x.itl_s < INF for x in a[1:])


def test_a_decode_worker_near_its_slots_queues_for_them_before_it_is_infeasible():
    """Requests that find a decode worker's slots full wait for one (M/G/c, a slot held for
    OSL - 1 steps): the wait, spread over the request's tokens, raises ITL as the slots fill;
    only a full batch that finishes requests slower than they come is infeasible. The KV
    holds fewer whole requests than max_num_seqs: it sets the slots."""
    from serve.autoscale.model import decode_slots

    e = Engine(STEP, max_num_seqs=16)
    load = lambda r: Load(r, [2000] * 50, [200] * 50)  # noqa: E731
    step16 = e.decode_s(16, 2100)
    saturation = 16 / (199 * step16)  # req/s one worker's 16 slots finish at full batch
    low, mid, high = (predict_disagg(e, e, 100, 1, load(saturation * f), 90) for f in (0.3, 0.8, 0.97))
    assert low.detail["decode_slot_wait_s"] == 0.0 and low.itl_s < mid.itl_s < high.itl_s < INF
    assert high.detail["decode_slot_wait_s"] > 0
    # the wait is spread over the request's OSL - 1 inter-token gaps, on top of the step
    assert high.itl_s >= high.detail["decode_slot_wait_s"] / 199
    assert predict_disagg(e, e, 100, 1, load(saturation * 1.01), 90).itl_s == INF
    assert predict_disagg(e, e, 100, 2, load(saturation * 1.01), 90).itl_s < INF  # two workers: half each
    small_kv = Engine(STEP, max_num_seqs=16, kv_tokens=4 * 2200)
    assert decode_slots(small_kv, 2000, 200) == 4 and decode_slots(e, 2000, 200) == 16
    assert predict_disagg(small_kv, small_kv, 100, 1, load(saturation * 0.5), 90).itl_s == INF  # 4 slots, not 16


def test_trend_follows_a_ramp_within_bounds():
    t = Trend()
    for k, rate in enumerate((10, 12, 14, 16)):
        t.update(Observation(30.0 * (k + 1), 30.0, int(rate * 30), [1000], [100]))
    assert 14 < t.rate_at(0) <= 16 and t.rate_at(60) > t.rate_at(0)
    assert t.rate_at(10_000) == pytest.approx(1.25 * t.level)  # capped: a step does not run away
    assert t.load(0, floor=20.0).rate == 20.0 and t.load(0).isl == [1000] * 3  # the last three intervals


def _obs(t: float, rate: float, pools: dict[str, int], **kw) -> Observation:
    return Observation(t, 30.0, int(rate * 30), [2000] * 40, [200] * 40,
                       pools={p: Pool(ready=n) for p, n in pools.items()}, **kw)


def _controller(**kw) -> Controller:
    pol = Policy("disagg", Targets(1.0, 0.05), Bounds(max_prefill=32, max_decode=32, max_workers=48), **kw)
    return Controller(pol, {"prefill": ENGINE, "decode": ENGINE})


def test_scales_up_at_once_in_bounded_steps_and_says_why():
    c = _controller()
    d = c.step(_obs(30, 10.0, {"prefill": 1, "decode": 1}))
    assert d.changed and d.desired["prefill"] > 1 and d.desired["prefill"] <= 5  # at most +4 (max_step_up_workers)
    assert "needed for" in d.reason and d.load["rate"] >= 10.0
    assert any(x["layout"] == d.desired for x in d.candidates)
    assert {"ttft_s", "itl_s", "meets", "workers"} <= set(d.candidates[0]) and d.observation["arrivals"] == 300


def test_a_step_up_is_the_larger_of_four_workers_and_double_the_pool():
    """Far more load than the pools carry (30 of each needed): a pool of 1 grows by 4 (not
    +200%, which is 2), a pool of 6 by 12 (+200%, more than 4)."""
    for cur, want in ((1, 5), (6, 18)):
        d = _controller().step(_obs(30, 250.0, {"prefill": cur, "decode": cur}))
        assert d.desired == {"prefill": want, "decode": want}, (cur, d.reason)
    d = _controller(max_step_up_workers=1).step(_obs(30, 250.0, {"prefill": 1, "decode": 1}))
    assert d.desired == {"prefill": 3, "decode": 3}, d.reason


def test_scale_down_waits_for_the_sustain_period_and_never_reverses_within_ten_minutes():
    c = _controller(cooldown_s=0.0, down_sustain_s=120.0, reverse_guard_s=0.0)  # the guard stays 600 s anyway
    up = c.step(_obs(30, 20.0, {"prefill": 2, "decode": 2}))
    assert up.desired["prefill"] > 2
    big = dict(up.desired)
    t, downs = 30.0, []
    while t < 900:
        t += 30
        d = c.step(_obs(t, 1.0, big))  # the load is gone
        if d.changed:
            downs.append(d)
            assert all(d.desired[p] <= d.current[p] for p in d.desired)
            big = dict(d.desired)
    assert downs and downs[0].t - 30 >= 600  # not before the reversal guard, whatever cooldown_s says
    first = downs[0]
    for p in first.desired:  # bounded: at most a quarter (at least one) per step
        assert first.current[p] - first.desired[p] <= max(1, math.floor(first.current[p] * 0.25))
    assert "margin" in first.reason


def test_a_brief_dip_does_not_scale_down():
    c = _controller(cooldown_s=0.0, down_sustain_s=300.0, reverse_guard_s=0.0)
    pools = {"prefill": 6, "decode": 6}
    for k in range(1, 41):
        rate = 1.0 if k % 8 == 0 else 8.0  # one quiet interval in eight
        d = c.step(_obs(30.0 * k, rate, pools))
        assert all(d.desired[p] >= d.current[p] for p in d.desired) or "margin" in d.reason
        pools = dict(d.desired)
    assert pools["prefill"] >= 2


def test_a_scale_down_holds_at_the_rate_s_upper_bound():
    """At a low rate one interval's count is noisy (1.3 req/s over 30 s: +-16%): a pool is
    shrunk only to a size that still meets the targets with margin one standard error above
    the rate, so the next noisy interval does not add a worker back (a reversal seen live)."""
    probe = _controller()

    def counts(r: float) -> tuple[int, int]:
        load = Load(r, [2000] * 40, [200] * 40)
        return probe.smallest("prefill", load, 0.8), probe.smallest("decode", load, 0.8)
    # a rate just below a step in the comfortable counts: its upper bound is past the step
    rate = next(r / 10 for r in range(5, 200) if counts(r / 10) != counts(r / 10 + math.sqrt(r / 10 / 30.0)))
    upper = Load(rate + math.sqrt(rate / 30.0), [2000] * 40, [200] * 40)
    ends = {}
    for z in (0.0, 1.0):
        c = _controller(cooldown_s=0.0, down_sustain_s=60.0, reverse_guard_s=0.0, max_step_down=1.0, down_rate_z=z)
        pools = {"prefill": 12, "decode": 12}
        for k in range(1, 12):
            pools = dict(c.step(_obs(30.0 * k, rate, pools)).desired)
        ends[z] = pools
        meets = c.smallest("prefill", upper, 0.8), c.smallest("decode", upper, 0.8)
        if z:
            assert (pools["prefill"], pools["decode"]) == meets  # comfortable at the upper bound, not below it
    assert sum(ends[0.0].values()) < sum(ends[1.0].values())  # without it, it shrinks further


def test_no_scale_down_while_the_load_rises():
    """Oversized pools on a rising load (a day's morning) hold until the trend turns."""
    c = _controller(cooldown_s=0.0, down_sustain_s=60.0, reverse_guard_s=0.0)
    pools = {"prefill": 8, "decode": 8}
    held = []
    for k in range(1, 13):
        d = c.step(_obs(30.0 * k, 1.0 + 0.05 * k, pools))  # low, and rising every interval
        assert not d.changed
        held.append(d.reason)
    assert any("rising" in r for r in held)
    for k in range(13, 30):  # flat, then falling: now it shrinks
        d = c.step(_obs(30.0 * k, 1.6 - 0.02 * (k - 13), pools))
        pools = dict(d.desired)
    assert pools["prefill"] < 8 and pools["decode"] < 8


def test_the_worker_cap_trims_additions():
    c = Controller(Policy("disagg", Targets(1.0, 0.05), Bounds(max_prefill=32, max_decode=32, max_workers=5)),
                   {"prefill": ENGINE, "decode": ENGINE})
    d = c.step(_obs(30, 20.0, {"prefill": 2, "decode": 2}))
    assert sum(d.desired.values()) <= 5 and "max-workers" in d.reason


def test_aggregated_pool_scales_on_both_targets():
    pol = Policy("agg", Targets(1.0, 0.05), Bounds(min_agg=1, max_agg=16, max_workers=16))
    c = Controller(pol, {"agg": ENGINE})
    d = c.step(_obs(30, 10.0, {"agg": 1}))
    assert set(d.desired) == {"agg"} and d.desired["agg"] > 1
    assert c.predict({"agg": 16}, LOAD).meets(1.0, 0.05)


def test_one_noisy_interval_does_not_undo_a_scale_down_but_a_sustained_rise_does():
    """Within the reversal guard of a scale-down, the rate just observed and the trend's
    forecast count by their lower bounds (`up_rate_z` standard errors below): one interval
    half a standard error past what the pool carries (a Poisson excursion, as a live ISL shift
    met 60 s after a scale-down) leaves it; a rise held does not. Without a recent scale-down
    the same interval adds a worker at once."""
    probe = _controller()

    def need(r: float) -> int:
        return probe.smallest("decode", Load(r, [2000] * 40, [200] * 40))
    se = lambda r: math.sqrt(r / 30.0)  # noqa: E731
    # T: the rate where the decode pool needs one worker more; hold below it, then cross it
    t = next(r / 100 for r in range(100, 4000) if need(r / 100) > max(3, need(r / 100 - 0.01)))
    hold, spike, risen = t - 0.5 * se(t), t + 0.5 * se(t), t + 1.2 * se(t)
    assert need(hold) == need(spike) - 1
    ups = {}
    for z, scaled_down in ((1.0, False), (0.0, True), (1.0, True)):
        c = _controller(up_rate_z=z, down_sustain_s=1e9)  # it takes no scale-down of its own here
        pools = {"prefill": 32, "decode": need(hold)}
        for k in range(1, 8):
            assert not c.step(_obs(30.0 * k, hold, pools)).changed
        if scaled_down:
            c.last_down["decode"] = 30.0 * 7  # as if that pool had just been shrunk to this size
        ups[(z, scaled_down)] = c.step(_obs(240.0, spike, pools)).desired["decode"] > pools["decode"]
    assert ups == {(1.0, False): True, (0.0, True): True, (1.0, True): False}
    later = [c.step(_obs(270.0 + 30.0 * j, risen, pools)).desired["decode"] for j in range(6)]
    assert max(later) > pools["decode"]  # held, the level follows it and the pool grows


def test_prompts_turning_long_size_the_prefill_pool_from_the_last_interval():
    """The length samples pool three intervals; the last one alone (at least MIN_SAMPLES
    requests) sizes a pool too, so a shift to long prompts is met one interval after it shows,
    not three."""
    from serve.autoscale.decide import MIN_SAMPLES

    def obs(t: float, isl: int, n: int) -> Observation:
        return Observation(t, 30.0, 450, [isl] * n, [200] * n,  # 15 req/s
                           pools={"prefill": Pool(ready=p), "decode": Pool(ready=32)})
    probe = _controller()
    low = 15.0 - math.sqrt(15.0 / 30.0)  # the lowest rate it may size for (the observed's lower bound)
    short, long_ = (probe.smallest("prefill", Load(r, [x] * 40, [200] * 40)) for r, x in ((15.0, 500), (low, 6000)))
    assert long_ > short + 1
    got = {}
    for n in (MIN_SAMPLES, MIN_SAMPLES - 1):
        c, p = _controller(max_step_up=100.0), short
        for k in range(1, 6):
            p = c.step(obs(30.0 * k, 500, 40)).desired["prefill"]
        assert p == short
        got[n] = c.step(obs(180.0, 6000, n)).desired["prefill"]
    assert got[MIN_SAMPLES] >= long_  # the last interval's prompts alone
    assert short < got[MIN_SAMPLES - 1] < long_  # too few for that: the pooled samples, still mostly short
