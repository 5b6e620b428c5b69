"""The load tracker, the filter stage and least-loaded picking: pure, no I/O."""

import random
from collections import Counter

import pytest

from router.errors import NoCandidates
from router.filters import WorkerView, compatible_with, eligible, kv_compatible
from router.load import LoadTracker
from router.router import Candidate, PrefillRouter
from router.scoring import load_cost


def cand(wid: str, inflight: int = 0, waiting: int = 0, kv: float = 0.0) -> Candidate:
    return Candidate(wid, inflight_requests=inflight, queued_requests=waiting, kv_usage=kv)


def router(seed: int = 0) -> PrefillRouter:
    return PrefillRouter(16, rng=random.Random(seed))


def test_cost_counts_requests_then_kv():
    assert load_cost(2, 1, 0.5) == pytest.approx(3.5)
    # A nearly full KV cache never outweighs a whole extra request.
    assert load_cost(1, 0, 0.99) < load_cost(2, 0, 0.0)


def test_agg_picks_lowest_load():
    d = router().route_agg([cand("a", 3), cand("b", 1), cand("c", 2)])
    assert d.worker_id == "b"
    assert [s.cost for s in d.scores] == [3, 1, 2]


def test_kv_usage_breaks_equal_request_counts():
    assert router().route_agg([cand("a", 1, kv=0.7), cand("b", 1, kv=0.2)]).worker_id == "b"


def test_agg_ties_are_spread_evenly():
    r = router(1)
    counts = Counter(r.route_agg([cand("a"), cand("b"), cand("c")]).worker_id for _ in range(3000))
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) > 850  # each ~1000


def test_no_candidates_is_an_error():
    with pytest.raises(NoCandidates):
        router().route_agg([])


def test_tracker_reserves_per_stage_and_releases_on_exit():
    t = LoadTracker()
    with t.reserve("w", "prefill", 5):
        with t.reserve("w", "decode", 7):
            assert t.requests("w") == 2
            assert t.requests("w", "prefill") == 1
            assert t.blocks("w", "prefill") == 5 and t.blocks("w", "decode") == 7
            assert t.total_requests() == 2
        assert t.requests("w") == 1 and t.blocks("w", "decode") == 0
    assert t.requests("w") == 0 and t.blocks("w", "prefill") == 0 and t.total_requests() == 0


def test_tracker_releases_when_the_body_raises():
    t = LoadTracker()
    with pytest.raises(RuntimeError):
        with t.reserve("w", "decode", 3):
            raise RuntimeError("stream failed")
    assert t.requests("w") == 0 and t.blocks("w", "decode") == 0


def test_tracker_refuses_an_unknown_stage():
    with pytest.raises(ValueError):
        LoadTracker().acquire("w", "agg")  # type: ignore[arg-type]


def test_filter_drops_draining_out_of_rotation_wrong_role_and_tried():
    views = [WorkerView("a", "decode"), WorkerView("b", "decode", draining=True),
             WorkerView("c", "decode", in_rotation=False), WorkerView("d", "prefill"), WorkerView("e", "decode")]
    assert [v.worker_id for v in eligible(views, ("decode",))] == ["a", "e"]
    assert [v.worker_id for v in eligible(views, ("decode",), exclude={"a"})] == ["e"]
    assert [v.worker_id for v in eligible(views, ("prefill", "decode"))] == ["a", "d", "e"]


def test_compatibility_is_block_size_and_kv_dtype():
    d = WorkerView("d", "decode", block_size=16, kv_cache_dtype="fp8")
    same = WorkerView("p1", "prefill", block_size=16, kv_cache_dtype="fp8")
    other_dtype = WorkerView("p2", "prefill", block_size=16, kv_cache_dtype="auto")
    other_bs = WorkerView("p3", "prefill", block_size=32, kv_cache_dtype="fp8")
    assert kv_compatible(d, same) and not kv_compatible(d, other_dtype) and not kv_compatible(d, other_bs)
    assert [v.worker_id for v in compatible_with([same, other_dtype, other_bs], d)] == ["p1"]
