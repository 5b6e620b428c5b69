"""Load scoring: pick the least-loaded worker, ties broken fairly.

`WorkerLoadView` is what the picker knows of a worker (the caller builds it from polled
load and its own in-flight count). `load_cost` is a pure function; `pick_least_loaded`
chooses among the lowest costs with a caller-supplied random source, so ties spread
evenly and tests are deterministic with a seeded `random.Random`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.errors import NoCandidates


@dataclass(frozen=True)
class WorkerLoadView:
    worker_id: str
    inflight: int  # requests this frontend has sent and not yet finished
    waiting: int  # requests queued in the engine's scheduler (polled)
    kv_usage: float  # 0..1 (polled)


def load_cost(w: WorkerLoadView) -> float:
    """Cost = in-flight requests + queued requests + KV usage.

    KV usage (0..1) only separates workers with the same request counts, so a worker
    near a full KV cache loses ties without outweighing a whole request.
    """
    return w.inflight + w.waiting + w.kv_usage


def pick_least_loaded(workers: Sequence[WorkerLoadView], rng: random.Random) -> WorkerLoadView:
    if not workers:
        raise NoCandidates("no worker to choose from")
    costs = [load_cost(w) for w in workers]
    best = min(costs)
    tied = [w for w, c in zip(workers, costs) if c - best < 1e-9]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
