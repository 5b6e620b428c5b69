"""Costs, ties, temperature and modes: pure, no I/O."""

import random
from collections import Counter

import pytest

from router.errors import NoCandidates
from router.hashing import block_hashes
from router.router import Candidate, PrefillRouter
from router.scoring import decode_cost, pick, prefill_cost

BS = 4


def test_costs():
    assert prefill_cost(1.0, prompt_blocks=10, overlap_blocks=4, inflight_prefill_blocks=3) == 9
    assert prefill_cost(2.0, 10, 10, 0) == 0
    assert decode_cost(active_blocks=20, queued_requests=2, blocks_per_request=5) == 30


def test_pick_lowest_and_fair_ties():
    rng = random.Random(3)
    assert pick([5, 2, 9], 0, rng) == 1
    counts = Counter(pick([1, 1, 4, 1], 0, rng) for _ in range(3000))
    assert set(counts) == {0, 1, 3} and min(counts.values()) > 850


def test_temperature_spreads_choices():
    rng = random.Random(0)
    cold = Counter(pick([0, 1, 2], 0.0, rng) for _ in range(1000))
    warm = Counter(pick([0, 1, 2], 1.0, rng) for _ in range(3000))
    assert cold == {0: 1000}
    assert warm[0] > warm[1] > warm[2] > 0


def router(**kw) -> PrefillRouter:
    return PrefillRouter(BS, rng=random.Random(1), **kw)


def test_kv_mode_prefers_cached_worker_unless_busy():
    r = router(use_kv_events=False)
    prompt = list(range(40))  # 10 blocks
    h = r.hashes(prompt)
    r.index.record_routed("b", h[:8])
    d = r.route_prefill(h, [Candidate("a"), Candidate("b")], len(prompt), record=False)
    assert d.worker_id == "b" and d.overlap_blocks == 8
    assert {s.worker_id: s.cost for s in d.scores} == {"a": 10, "b": 2}
    # b is busy with 12 blocks of prefill in flight: a is cheaper now.
    d = r.route_prefill(h, [Candidate("a"), Candidate("b", inflight_prefill_blocks=12)], len(prompt), record=False)
    assert d.worker_id == "a"


def test_overlap_weight():
    r = router(use_kv_events=False, overlap_weight=3.0)
    h = r.hashes(list(range(40)))
    r.index.record_routed("b", h[:2])
    d = r.route_prefill(h, [Candidate("a"), Candidate("b", inflight_prefill_blocks=5)], 40, record=False)
    assert {s.worker_id: s.cost for s in d.scores} == {"a": 30, "b": 29}
    assert d.worker_id == "b"


def test_approximate_mode_records_decisions():
    r = router(use_kv_events=False)
    prompt = list(range(16))
    h = r.hashes(prompt)
    first = r.route_prefill(h, [Candidate("a"), Candidate("b")], 16)
    again = r.route_prefill(h, [Candidate("a"), Candidate("b")], 16)
    assert again.worker_id == first.worker_id and again.overlap_blocks == 4


def test_round_robin_and_random_ignore_cache():
    r = router(mode="round-robin", use_kv_events=False)
    h = r.hashes(list(range(16)))
    cands = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert [r.route_prefill(h, cands, 16).worker_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    r = router(mode="random")
    assert set(r.route_prefill(h, cands, 16).worker_id for _ in range(60)) == {"a", "b", "c"}
    with pytest.raises(ValueError):
        router(mode="fancy")


def test_decode_by_load():
    r = router()
    d = r.route_decode([], [Candidate("a", active_blocks=50), Candidate("b", active_blocks=10, queued_requests=1)], 20)
    assert d.worker_id == "b"
    with pytest.raises(NoCandidates):
        r.route_decode([], [], 20)


def test_cached_ratio():
    r = router(use_kv_events=False)
    h = block_hashes(list(range(40)), BS)
    r.index.record_routed("a", h[:5])
    d = r.route_prefill(h, [Candidate("a")], 40, record=False)
    assert d.cached_ratio == 0.5
