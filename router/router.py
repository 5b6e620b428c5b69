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

import functools
import itertools
import operator
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from router.errors import NoCandidates
from router.hashing import block_hashes
from router.index import PrefixIndex
from router.scoring import load_cost, pick, prefill_cost

Mode = Literal["kv", "round-robin", "random"]


class Candidate(NamedTuple):
    """What the router knows of one worker for one decision (a tuple: one is built per
    worker per decision, so it must be cheap at 1,000 workers)."""

    worker_id: str
    inflight_prefill_blocks: int = 0
    active_blocks: int = 0
    queued_requests: int = 0
    inflight_requests: int = 0  # from this frontend, every stage
    kv_usage: float = 0.0


@dataclass(slots=True)
class WorkerScore:
    worker_id: str
    overlap_blocks: int
    load: float
    cost: float


@dataclass(frozen=True)
class Decision:
    """The chosen worker, and every candidate's score (built only when read: explain, tests)."""

    worker_id: str
    prompt_blocks: int
    overlap_blocks: int
    candidates: Sequence[Candidate] = ()
    costs: Sequence[float] = ()
    overlaps: Mapping[str, int] = field(default_factory=dict)
    load_field: str = "inflight_prefill_blocks"  # the Candidate field shown as each worker's load; "" = cost
    cost_offset: float = 0.0  # added to every entry of `costs` (a term all candidates share)

    @property
    def cached_ratio(self) -> float:
        return self.overlap_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @functools.cached_property
    def scores(self) -> list[WorkerScore]:
        get, f, off = self.overlaps.get, self.load_field, self.cost_offset
        return [WorkerScore(c.worker_id, get(c.worker_id, 0), float(getattr(c, f) if f else cost + off), cost + off)
                for c, cost in zip(self.candidates, self.costs)]


_WORKER_ID = operator.itemgetter(0)
_INFLIGHT_PREFILL = operator.itemgetter(1)


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

    def route_prefill(self, hashes: Sequence[int], candidates: Sequence[Candidate], num_tokens: int,
                      record: bool = True) -> Decision:
        if not candidates:
            raise NoCandidates("no prefill worker")
        prompt_blocks = -(-num_tokens // self.block_size)
        overlaps = self.index.overlaps(hashes)
        w = self.overlap_weight
        # prefill_cost(w, P, o, inflight) = w * P + (inflight - w * o): the first term is the
        # same for every candidate, so the choice is made on the second (built in C where it
        # can be: this is the hot loop at 1,000 workers) and the costs are offset for display.
        rel = list(map(_INFLIGHT_PREFILL, candidates))
        if overlaps:
            get = overlaps.get
            if len(overlaps) * 8 < len(candidates):  # few holders: find them (in C) among the candidates
                ids = list(map(_WORKER_ID, candidates))
                for wid, o in overlaps.items():
                    start = 0
                    while True:  # every candidate of that id (ids are unique from the frontend)
                        try:
                            i = ids.index(wid, start)
                        except ValueError:  # no (more) candidate holding these blocks
                            break
                        rel[i] -= w * o
                        start = i + 1
            else:
                rel = [r - w * get(c[0], 0) for r, c in zip(rel, candidates)]
        if self.mode == "round-robin":
            i = next(self._rr) % len(candidates)
        elif self.mode == "random":
            i = self.rng.randrange(len(candidates))
        else:
            i = pick(rel, self.temperature, self.rng, exact=float(w).is_integer())
        chosen = candidates[i].worker_id
        if record and not self.use_kv_events:
            self.index.record_routed(chosen, hashes)
        return Decision(chosen, prompt_blocks, overlaps.get(chosen, 0), candidates, rel, overlaps,
                        cost_offset=prefill_cost(w, prompt_blocks, 0, 0))

    def route_decode(self, hashes: Sequence[int], candidates: Sequence[Candidate], num_tokens: int) -> Decision:
        if not candidates:
            raise NoCandidates("no decode worker")
        prompt_blocks = -(-num_tokens // self.block_size)
        overlaps = self.index.overlaps(hashes)
        # decode_cost(active, queued, P) = active + queued * P, unrolled (the hot loop at scale).
        costs = [c[2] + c[3] * prompt_blocks for c in candidates]
        i = pick(costs, self.temperature, self.rng, exact=True)
        chosen = candidates[i].worker_id
        return Decision(chosen, prompt_blocks, overlaps.get(chosen, 0), candidates, costs, overlaps, load_field="")

    def route_agg(self, candidates: Sequence[Candidate], num_tokens: int = 0) -> Decision:
        """The least-loaded candidate (requests in flight + queued + KV usage), ties at random."""
        if not candidates:
            raise NoCandidates("no worker available")
        prompt_blocks = -(-num_tokens // self.block_size) if num_tokens else 0
        costs = [load_cost(c[4], c[3], c[5]) for c in candidates]
        i = pick(costs, 0.0, self.rng, exact=True)
        return Decision(candidates[i].worker_id, prompt_blocks, 0, candidates, costs, {},
                        load_field="inflight_requests")
