"""The PrefillRouter: state producers (prefix index) + pure scoring + one picker.

`route_prefill` picks the prefill worker for a prompt: in `kv` mode by cost (uncached
blocks, weighted, plus in-flight prefill blocks); `round-robin` and `random` ignore the
cache. `route_decode` picks a decode worker by load (active blocks and queue);
`route_agg` an aggregated worker (or a retry's next worker) by request load. All three
score the candidates that passed the filter stage (`router.filters`) and hand the costs to
the one picker, `scoring.pick`. Every decision carries the per-worker overlap, load and
cost, which is what `POST /v1/route/explain` returns.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from router.errors import NoCandidates
from router.hashing import block_hashes
from router.index import PrefixIndex
from router.scoring import decode_cost, load_cost, pick, prefill_cost

Mode = Literal["kv", "round-robin", "random"]


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    inflight_prefill_blocks: int = 0
    active_blocks: int = 0
    queued_requests: int = 0
    inflight_requests: int = 0  # from this frontend, every stage
    kv_usage: float = 0.0


@dataclass(slots=True)
class WorkerScore:  # plain slots dataclass: one is built per worker per decision (hot path)
    worker_id: str
    overlap_blocks: int
    load: float
    cost: float


@dataclass(frozen=True)
class Decision:
    worker_id: str
    prompt_blocks: int
    overlap_blocks: int
    scores: list[WorkerScore] = field(default_factory=list)

    @property
    def cached_ratio(self) -> float:
        return self.overlap_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


class PrefillRouter:
    def __init__(self, block_size: int, mode: Mode = "kv", overlap_weight: float = 1.0, temperature: float = 0.0,
                 use_kv_events: bool = True, ttl_s: float = 120.0, rng: random.Random | None = None) -> None:
        if mode not in ("kv", "round-robin", "random"):
            raise ValueError(f"unknown router mode {mode!r}")
        self.block_size = block_size
        self.mode = mode
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.use_kv_events = use_kv_events
        self.index = PrefixIndex(block_size, ttl_s)
        self.rng = rng or random.Random()
        self._rr = itertools.count()

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return block_hashes(token_ids, self.block_size)

    def _score(self, hashes: Sequence[int], candidates: Sequence[Candidate], prompt_blocks: int) -> list[WorkerScore]:
        overlaps = self.index.overlaps(hashes)
        w = self.overlap_weight
        return [WorkerScore(c.worker_id, (o := overlaps.get(c.worker_id, 0)), float(c.inflight_prefill_blocks),
                            prefill_cost(w, prompt_blocks, o, c.inflight_prefill_blocks)) for c in candidates]

    def route_prefill(self, hashes: Sequence[int], candidates: Sequence[Candidate], num_tokens: int,
                      record: bool = True) -> Decision:
        if not candidates:
            raise NoCandidates("no prefill worker")
        prompt_blocks = -(-num_tokens // self.block_size)
        scores = self._score(hashes, candidates, prompt_blocks)
        if self.mode == "round-robin":
            i = next(self._rr) % len(candidates)
        elif self.mode == "random":
            i = self.rng.randrange(len(candidates))
        else:
            i = pick([s.cost for s in scores], self.temperature, self.rng)
        chosen = scores[i]
        if record and not self.use_kv_events:
            self.index.record_routed(chosen.worker_id, hashes)
        return Decision(chosen.worker_id, prompt_blocks, chosen.overlap_blocks, scores)

    def route_decode(self, hashes: Sequence[int], candidates: Sequence[Candidate], num_tokens: int) -> Decision:
        if not candidates:
            raise NoCandidates("no decode worker")
        prompt_blocks = -(-num_tokens // self.block_size)
        scores = []
        overlaps = self.index.overlaps(hashes)
        for c in candidates:
            cost = decode_cost(c.active_blocks, c.queued_requests, prompt_blocks)
            scores.append(WorkerScore(c.worker_id, overlaps.get(c.worker_id, 0), float(cost), cost))
        i = pick([s.cost for s in scores], self.temperature, self.rng)
        return Decision(scores[i].worker_id, prompt_blocks, scores[i].overlap_blocks, scores)

    def route_agg(self, candidates: Sequence[Candidate], num_tokens: int = 0) -> Decision:
        """The least-loaded candidate (requests in flight + queued + KV usage), ties at random."""
        if not candidates:
            raise NoCandidates("no worker available")
        prompt_blocks = -(-num_tokens // self.block_size) if num_tokens else 0
        scores = [WorkerScore(c.worker_id, 0, float(c.inflight_requests),
                              load_cost(c.inflight_requests, c.queued_requests, c.kv_usage)) for c in candidates]
        i = pick([s.cost for s in scores], 0.0, self.rng)
        return Decision(scores[i].worker_id, prompt_blocks, 0, scores)
