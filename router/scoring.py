"""Routing costs as pure functions, and the picker. No state, no I/O.

Prefill cost = overlap weight x (prompt blocks not cached on that worker)
               + that worker's in-flight prefill blocks.
Decode cost  = active blocks on that worker + its queued requests x blocks per request.
Load cost    = requests in flight from this frontend + queued requests + KV usage (0..1),
               for aggregated workers and retries.
Lowest cost wins; with temperature > 0 a worker is drawn with probability
softmax(-cost / (temperature x spread)), spread being the cost range, so temperature is
scale-free; ties among the lowest cost are broken at random, evenly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def prefill_cost(weight: float, prompt_blocks: int, overlap_blocks: int, inflight_prefill_blocks: int) -> float:
    return weight * (prompt_blocks - overlap_blocks) + inflight_prefill_blocks


def decode_cost(active_blocks: int, queued_requests: int, blocks_per_request: float) -> float:
    return active_blocks + queued_requests * blocks_per_request


def load_cost(inflight_requests: int, queued_requests: int, kv_usage: float) -> float:
    """KV usage (0..1) only separates workers with the same request counts, so a worker near
    a full KV cache loses ties without outweighing a whole request."""
    return inflight_requests + queued_requests + kv_usage


def pick(costs: Sequence[float], temperature: float, rng: random.Random, exact: bool = False) -> int:
    """`exact`: the costs are computed without rounding (integers, or the same operations on
    equal inputs), so a tie is an equal value and the search for one runs in C (the
    decision at 1,000 workers); otherwise costs within 1e-9 of the lowest tie."""
    if not costs:
        raise ValueError("no candidates")
    best = min(costs)
    if temperature <= 0:
        if exact and isinstance(costs, list):
            n = costs.count(best)
            if n == 1:
                return costs.index(best)
            tied, i = [], -1
            for _ in range(n):
                i = costs.index(best, i + 1)
                tied.append(i)
        else:
            tied = [i for i, c in enumerate(costs) if c - best < 1e-9]
        return tied[0] if len(tied) == 1 else rng.choice(tied)
    spread = (max(costs) - best) or 1.0
    weights = [math.exp(-(c - best) / (temperature * spread)) for c in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]
