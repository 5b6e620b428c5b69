"""Load scoring: pure functions, no I/O."""

import random
from collections import Counter

import pytest

from router.errors import NoCandidates
from router.load import WorkerLoadView, load_cost, pick_least_loaded


def view(wid: str, inflight: int = 0, waiting: int = 0, kv: float = 0.0) -> WorkerLoadView:
    return WorkerLoadView(worker_id=wid, inflight=inflight, waiting=waiting, kv_usage=kv)


def test_cost_counts_requests_then_kv():
    assert load_cost(view("a", 2, 1, 0.5)) == pytest.approx(3.5)
    # A nearly full KV cache never outweighs a whole extra request.
    assert load_cost(view("a", 1, 0, 0.99)) < load_cost(view("b", 2, 0, 0.0))


def test_picks_lowest_cost():
    rng = random.Random(0)
    workers = [view("a", 3), view("b", 1), view("c", 2)]
    assert pick_least_loaded(workers, rng).worker_id == "b"


def test_kv_usage_breaks_equal_request_counts():
    rng = random.Random(0)
    assert pick_least_loaded([view("a", 1, kv=0.7), view("b", 1, kv=0.2)], rng).worker_id == "b"


def test_ties_are_spread_evenly():
    rng = random.Random(1)
    workers = [view("a"), view("b"), view("c")]
    counts = Counter(pick_least_loaded(workers, rng).worker_id for _ in range(3000))
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) > 850  # each ~1000


def test_no_candidates():
    with pytest.raises(NoCandidates):
        pick_least_loaded([], random.Random(0))
