"""The routing's caches at scale (eligible lists, candidates patched from the load tracker)
never serve a stale decision: every change a fresh computation would see, they see."""

from __future__ import annotations

import random

from router.load import CHANGE_LOG, LoadTracker
from router.router import Candidate
from router.scoring import pick
from serve import protocol as p
from serve.frontend.pool import WorkerPool
from serve.frontend.routing import Routing
from serve.frontend.settings import FrontendSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(i: int, role: str, block_size: int = 16, dtype: str = "auto") -> p.WorkerInfo:
    return p.WorkerInfo(worker_id=f"w{i}", role=role, url=f"http://w{i}", model="m",  # type: ignore[arg-type]
                        served_model_name="m", max_model_len=4096, block_size=block_size, kv_cache_dtype=dtype)


def setup(n_prefill: int, n_decode: int, lease: float = 1e9) -> tuple[Routing, WorkerPool, Clock]:
    clock = Clock()
    pool = WorkerPool("m", [], 1.0, 3, client=None, clock=clock)  # type: ignore[arg-type]
    for i in range(n_prefill + n_decode):
        pool.register(p.Registration(info=info(i, "prefill" if i < n_prefill else "decode"), lease_seconds=lease))
    routing = Routing(FrontendSettings(model="m", served_model_name="m", block_size=16), pool)
    return routing, pool, clock


def fresh_candidates(routing: Routing, role: str) -> list[Candidate]:
    views = [e for e in routing.pool.workers.values() if e.in_rotation and e.info and e.info.role == role]
    return [routing._candidate(e) for e in views]


def test_cached_candidates_follow_every_change_a_fresh_build_sees():
    routing, pool, clock = setup(6, 6)
    rng = random.Random(0)
    urls = list(pool.workers)
    for step in range(300):
        action = rng.randrange(6)
        u = rng.choice(urls)
        if action == 0:
            routing.load.acquire(u, rng.choice(["prefill", "decode"]), rng.randrange(1, 9))
        elif action == 1:
            routing.load.release(u, "prefill", 1)
        elif action == 2:
            pool.workers[u].load = p.WorkerLoad(worker_id=u, active_requests=1, running_requests=1,
                                                waiting_requests=rng.randrange(3), kv_usage=rng.random(),
                                                active_blocks=rng.randrange(50), draining=rng.random() < 0.1)
        elif action == 3:
            pool.workers[u].healthy = rng.random() < 0.7
        for role in ("prefill", "decode"):
            got = routing._candidates(routing.eligible((role,)))
            want = [c for c in fresh_candidates(routing, role)
                    if not (pool.workers[c.worker_id].load and pool.workers[c.worker_id].load.draining)]
            assert got == want, (step, role)


def test_a_lease_that_runs_out_leaves_the_cached_list_without_any_other_change():
    routing, pool, clock = setup(2, 2)
    pool.register(p.Registration(info=info(9, "decode"), lease_seconds=5))
    assert "http://w9" in [e.url for e in routing.eligible(("decode",))]
    clock.now += 6  # no entry changed; only time passed
    assert "http://w9" not in [e.url for e in routing.eligible(("decode",))]
    plan = routing.plan(list(range(64)))
    assert plan.decode.url != "http://w9"


def test_a_new_worker_and_a_different_kv_layout_are_seen_at_once():
    routing, pool, _ = setup(2, 2)
    assert len(routing.eligible(("prefill",))) == 2
    pool.register(p.Registration(info=info(7, "prefill", dtype="fp8"), lease_seconds=1e9))
    assert len(routing.eligible(("prefill",))) == 3
    # Only the two bf16 ("auto") prefill workers can hand KV to an "auto" decode worker.
    for _ in range(20):
        plan = routing.plan(list(range(64)))
        assert plan.prefill is not None and plan.prefill.url != "http://w7"


def test_the_change_log_says_when_it_forgot():
    t = LoadTracker()
    start = t.seq
    t.acquire("a", "prefill", 1)
    t.release("a", "prefill", 1)
    assert t.changes_since(start) == ["a", "a"] and t.changes_since(t.seq) == []
    for _ in range(CHANGE_LOG + 10):
        t.acquire("b", "decode")
    assert t.changes_since(start) is None  # too old: rebuild
    assert t.changes_since(t.seq - 3) == ["b"] * 3


def test_exact_ties_pick_as_the_tolerant_search_does():
    for seed in range(50):
        rng = random.Random(seed)
        costs = [float(rng.randrange(5)) for _ in range(rng.randrange(1, 40))]
        a, b = random.Random(seed), random.Random(seed)
        assert pick(costs, 0.0, a, exact=True) == pick(costs, 0.0, b)
