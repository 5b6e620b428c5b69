"""Where a request runs: the frontend's glue between its worker pool and the PrefillRouter.

Routing is filter -> scorers -> one picker (see `router/`): the pool's workers become
`WorkerView`s, the filter stage drops those out of rotation, draining, of the wrong role,
already tried, or whose KV layout cannot exchange blocks with the other stage's worker;
the router scores the rest with what the pool polled and what the load tracker holds.

With prefill workers in rotation a request is split: the router picks a decode worker (load)
and a prefill worker (KV overlap and load). With `conditional_disagg_tokens` N > 0, a prompt
whose uncached part on the chosen decode worker is below N tokens skips the prefill stage;
with `conditional_disagg_auto` it skips it when moving the KV costs more than the decode
worker's own prefill would (`router.split`, from the transfers and prefills measured here).
Decode workers without any (compatible) prefill worker run prefill locally (a fallback);
with only aggregated workers the request runs on the least-loaded one (aggregated mode).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from router.errors import NoCandidates
from router.filters import compatible_with, eligible
from router.load import LoadTracker
from router.router import Candidate, Decision, PrefillRouter
from router.split import SplitCosts, SplitEstimate, decide
from serve import protocol as p
from serve.errors import NoWorkerAvailable
from serve.frontend.pool import WorkerEntry, WorkerPool
from serve.frontend.settings import FrontendSettings


@dataclass
class RoutePlan:
    decode: WorkerEntry
    prefill: WorkerEntry | None = None
    hashes: list[int] = field(default_factory=list)
    prompt_blocks: int = 0
    reason: str = "agg"  # agg | disagg | conditional | no-prefill-worker
    prefill_decision: Decision | None = None
    decode_decision: Decision | None = None
    transfer_bytes: int = 0  # split requests: what the decode worker reads (its uncached blocks' bytes)
    uncached_tokens: int = 0  # the prompt's tokens not cached on the decode worker (the router's view)
    split: SplitEstimate | None = None  # --conditional-disagg-tokens auto: the estimates behind the choice
    split_why: str = ""

    @property
    def is_fallback(self) -> bool:
        return self.reason == "no-prefill-worker"

    @property
    def decode_roles(self) -> tuple[str, ...]:
        return ("agg",) if self.reason == "agg" else ("decode",)


Plan = RoutePlan  # the name before the planner's Plan existed


class Routing:
    def __init__(self, settings: FrontendSettings, pool: WorkerPool, load: LoadTracker | None = None) -> None:
        self.settings = settings
        self.pool = pool
        self.load = load or LoadTracker()
        self.router = PrefillRouter(settings.block_size, settings.router_mode, settings.kv_overlap_score_weight,
                                    settings.router_temperature, settings.use_kv_events)
        # Caches for decisions at scale (see `eligible`, `_candidates`).
        self._eligible: dict[tuple[str, ...], list[WorkerEntry]] = {}  # roles -> entries
        self._compat: dict[tuple, tuple[list[WorkerEntry], list[WorkerEntry]]] = {}  # -> (entries, compatible)
        self._views_key: tuple[int, int] = (-1, -1)
        self._views_horizon = float("inf")
        self._cands: dict[int, tuple] = {}
        self.costs = SplitCosts(pool.clock)  # measured transfers and prefills (auto conditional disaggregation)

    # -- filter stage -----------------------------------------------------------------
    def eligible(self, roles: Collection[str], exclude: Collection[str] = ()) -> list[WorkerEntry]:
        """The filter stage's survivors. Without `exclude` the list is cached until a worker
        entry changes or a lease runs out (a decision at 1,000 workers must not rebuild 1,000
        views); do not modify it."""
        if exclude:
            views = eligible((e.view() for e in self.pool.workers.values()), roles, exclude)
            return [self.pool.workers[v.worker_id] for v in views]
        now = self.pool.lease_clock()
        if (WorkerEntry.version, len(self.pool.workers)) != self._views_key or now >= self._views_horizon:
            self._eligible.clear()
            self._compat.clear()
            self._views_key = (WorkerEntry.version, len(self.pool.workers))
            self.costs.prune(self.pool.workers)  # lines of workers gone from the pool
            self._views_horizon = min((e.lease_expiry for e in self.pool.workers.values()
                                       if e.lease_expiry > now), default=float("inf"))
        key = tuple(roles)
        cached = self._eligible.get(key)
        if cached is None:
            views = eligible((e.view() for e in self.pool.workers.values()), roles)
            cached = self._eligible[key] = [self.pool.workers[v.worker_id] for v in views]
        return cached

    def _compatible(self, entries: list[WorkerEntry], peer: WorkerEntry) -> list[WorkerEntry]:
        """The entries that can exchange KV with `peer` (cached with the eligible lists, per KV
        layout: block size and dtype)."""
        pv = peer.view()
        key = (id(entries), pv.block_size, pv.kv_cache_dtype)
        cached = self._compat.get(key)
        if cached is not None and cached[0] is entries:
            return cached[1]
        out = [self.pool.workers[v.worker_id] for v in compatible_with((e.view() for e in entries), pv)]
        if len(out) == len(entries):
            out = entries  # all compatible (the common case): the cached list itself
        if self._is_cached(entries):
            self._compat[key] = (entries, out)
        return out

    def _is_cached(self, entries: list[WorkerEntry]) -> bool:
        """A list this routing keeps (so its candidates may be kept with it)."""
        return any(entries is v for v in self._eligible.values()) or any(entries is c for _, c in self._compat.values())

    def _candidate(self, e: WorkerEntry) -> Candidate:
        load = e.load
        return Candidate(e.url,
                         inflight_prefill_blocks=self.load.blocks(e.url, "prefill"),
                         active_blocks=(load.active_blocks if load else 0) + self.load.blocks(e.url, "decode"),
                         queued_requests=load.waiting_requests if load else 0,
                         inflight_requests=self.load.requests(e.url),
                         kv_usage=load.kv_usage if load else 0.0)

    def _candidates(self, entries: list[WorkerEntry]) -> list[Candidate]:
        """Candidates for `entries` (a list `eligible` cached): kept with the list and patched
        for the workers whose tracked load changed since, rebuilt when an entry changed."""
        c = self._cands.get(id(entries))
        if c is None or c[0] is not entries or c[1] != WorkerEntry.version:
            cands = [self._candidate(e) for e in entries]
            if self._is_cached(entries):
                index = {e.url: i for i, e in enumerate(entries)}
                self._cands = {k: v for k, v in self._cands.items() if self._is_cached(v[0])}
                self._cands[id(entries)] = (entries, WorkerEntry.version, self.load.seq, cands, index)
            return list(cands)
        _, version, seq, cands, index = c
        changed = self.load.changes_since(seq)
        if changed is None:
            del self._cands[id(entries)]
            return self._candidates(entries)
        for url in set(changed):
            i = index.get(url)
            if i is not None:
                cands[i] = self._candidate(entries[i])
        self._cands[id(entries)] = (entries, version, self.load.seq, cands, index)
        return list(cands)

    def _block_size(self) -> int:
        for e in self.pool.workers.values():
            if e.info is not None and e.in_rotation:
                return e.info.block_size
        return self.settings.block_size

    # -- decisions --------------------------------------------------------------------
    def plan(self, prompt_ids: list[int], dry_run: bool = False) -> RoutePlan:
        bs = self._block_size()
        if bs != self.router.block_size:  # workers decide the block size; the index follows
            self.router.block_size = self.router.index.block_size = bs
        prefill = self.eligible(("prefill",))
        decode = self.eligible(("decode",))
        n = len(prompt_ids)
        if not decode:
            agg = self.eligible(("agg",))
            if not agg:
                raise NoWorkerAvailable("no worker available" if not prefill else "no decode worker available")
            d = self.router.route_agg(self._candidates(agg), n)
            return RoutePlan(decode=self.pool.workers[d.worker_id], prompt_blocks=d.prompt_blocks, reason="agg")
        hashes = self.router.hashes(prompt_ids)
        try:
            dd = self.router.route_decode(hashes, self._candidates(decode), n)
        except NoCandidates as exc:
            raise NoWorkerAvailable(str(exc)) from None
        chosen = self.pool.workers[dd.worker_id]
        plan = RoutePlan(decode=chosen, hashes=hashes, prompt_blocks=dd.prompt_blocks, decode_decision=dd)
        threshold = self.settings.conditional_disagg_tokens
        uncached = plan.uncached_tokens = max(0, n - dd.overlap_blocks * bs)
        if threshold > 0 and uncached < threshold:
            plan.reason = "conditional"
            return plan
        prefill = self._compatible(prefill, chosen)
        if not prefill:
            plan.reason = "no-prefill-worker"
            return plan
        auto = self.settings.conditional_disagg_auto
        pd = self.router.route_prefill(hashes, self._candidates(prefill), n, record=not (dry_run or auto))
        holder = self.pool.workers[pd.worker_id]
        uncached_blocks = max(0, dd.prompt_blocks - dd.overlap_blocks)
        bpb = holder.info.kv_bytes_per_block if holder.info is not None else 0
        plan.transfer_bytes = uncached_blocks * bpb  # 0 where the holder does not say its block bytes
        if auto:
            est = self.costs.estimate(uncached_tokens=uncached,
                                      transfer_bytes=plan.transfer_bytes if bpb else None,
                                      prefill_worker=holder.url, decode_worker=chosen.url,
                                      queued_prefill_tokens=self.load.blocks(holder.url, "prefill") * bs)
            split, plan.split_why = decide(est)
            plan.split = est
            if not split:
                plan.reason = "conditional"
                return plan
            if not dry_run and not self.router.use_kv_events:
                self.router.index.record_routed(pd.worker_id, hashes)
        plan.prefill = holder
        plan.prefill_decision = pd
        plan.reason = "disagg"
        return plan

    def decode_for(self, plan: RoutePlan, num_tokens: int) -> RoutePlan:
        """A split request's decode worker chosen again as its prefill ends, by the load then
        (the choice at arrival saw none of the requests still in their prefill: a burst's would
        all stay with the decode workers there when it came, however many joined since), among
        those that can read the prefill worker's KV. `plan` itself when the choice is the same
        or no decode worker is eligible now (the decode stage's retries handle that)."""
        if plan.prefill is None:
            return plan
        decode = self._compatible(self.eligible(("decode",)), plan.prefill)
        if not decode:
            return plan
        dd = self.router.route_decode(plan.hashes, self._candidates(decode), num_tokens)
        chosen = self.pool.workers[dd.worker_id]
        return plan if chosen is plan.decode else replace(plan, decode=chosen, decode_decision=dd)

    def next_worker(self, roles: Collection[str], tried: Collection[str], num_tokens: int = 0) -> WorkerEntry:
        """A retry's worker: the least loaded of `roles` not yet tried."""
        entries = self.eligible(roles, exclude=tried)
        if not entries:
            raise NoWorkerAvailable("no worker available")
        d = self.router.route_agg([self._candidate(e) for e in entries], num_tokens)
        return self.pool.workers[d.worker_id]

    def explain(self, prompt_ids: list[int]) -> p.ExplainReply:
        plan = self.plan(prompt_ids, dry_run=True)

        def stage(d: Decision | None, chosen: WorkerEntry | None) -> p.ExplainStage | None:
            if d is None:
                return p.ExplainStage(chosen=chosen.url, workers=[]) if chosen is not None else None
            return p.ExplainStage(chosen=d.worker_id, cached_ratio=d.cached_ratio, workers=[
                p.ExplainScore(worker=s.worker_id, overlap_blocks=s.overlap_blocks, load=s.load, cost=s.cost)
                for s in d.scores])

        split = None
        if plan.split is not None:
            e = plan.split
            split = p.ExplainSplit(choice="split" if plan.reason == "disagg" else "local", why=plan.split_why,
                                   uncached_tokens=e.uncached_tokens, transfer_bytes=e.transfer_bytes,
                                   transfer_ms=_ms(e.transfer_s), prefill_queue_ms=_ms(e.prefill_queue_s),
                                   local_prefill_ms=_ms(e.local_prefill_s), bandwidth_gbps=e.bandwidth_gbps,
                                   read_latency_ms=_ms(e.read_latency_s))
        return p.ExplainReply(prompt_tokens=len(prompt_ids), prompt_blocks=plan.prompt_blocks, mode=self.router.mode,
                              path=plan.reason, prefill=stage(plan.prefill_decision, plan.prefill),
                              decode=stage(plan.decode_decision, plan.decode), split=split)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
