"""Where a request runs: the frontend's glue between its worker pool and the PrefillRouter.

With prefill workers in rotation a request is split: the router picks a prefill worker (KV
overlap and load) and a decode worker (load). With `conditional_disagg_tokens` N > 0, a
prompt whose uncached part on the chosen decode worker is below N tokens skips the prefill
stage. Decode workers without any prefill worker run prefill locally (a fallback); with only
aggregated workers the request runs on the least-loaded one (aggregated mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.errors import NoCandidates
from router.router import Candidate, Decision, PrefillRouter
from serve.errors import NoWorkerAvailable
from serve.frontend.pool import WorkerEntry, WorkerPool
from serve.frontend.settings import FrontendSettings


@dataclass
class Plan:
    decode: WorkerEntry
    prefill: WorkerEntry | None = None
    hashes: list[int] = field(default_factory=list)
    prompt_blocks: int = 0
    reason: str = "agg"  # agg | disagg | conditional | no-prefill-worker
    prefill_decision: Decision | None = None
    decode_decision: Decision | None = None

    @property
    def is_fallback(self) -> bool:
        return self.reason == "no-prefill-worker"


class Routing:
    def __init__(self, settings: FrontendSettings, pool: WorkerPool) -> None:
        self.settings = settings
        self.pool = pool
        self.router = PrefillRouter(settings.block_size, settings.router_mode, settings.kv_overlap_score_weight,
                                    settings.router_temperature, settings.use_kv_events)
        self.inflight_prefill_blocks: dict[str, int] = {}
        self.inflight_decode_blocks: dict[str, int] = {}

    def _block_size(self) -> int:
        for e in self.pool.available():
            if e.info is not None:
                return e.info.block_size
        return self.settings.block_size

    def plan(self, prompt_ids: list[int], dry_run: bool = False) -> Plan:
        bs = self._block_size()
        if bs != self.router.block_size:  # workers decide the block size; the index follows
            self.router.block_size = self.router.index.block_size = bs
        prefill = self.pool.available(("prefill",))
        decode = self.pool.available(("decode",))
        if not decode:
            agg = self.pool.available(("agg",))
            if not agg:
                raise NoWorkerAvailable("no worker available" if not prefill else "no decode worker available")
            return Plan(decode=self.pool.pick(("agg",)), reason="agg")
        hashes = self.router.hashes(prompt_ids)
        n = len(prompt_ids)
        cands = [Candidate(e.url, active_blocks=(e.load.active_blocks if e.load else 0)
                           + self.inflight_decode_blocks.get(e.url, 0),
                           queued_requests=e.load.waiting_requests if e.load else 0) for e in decode]
        try:
            dd = self.router.route_decode(hashes, cands, n)
        except NoCandidates as exc:
            raise NoWorkerAvailable(str(exc)) from None
        plan = Plan(decode=self.pool.workers[dd.worker_id], hashes=hashes, prompt_blocks=dd.prompt_blocks,
                    decode_decision=dd)
        threshold = self.settings.conditional_disagg_tokens
        uncached = n - dd.overlap_blocks * bs
        if threshold > 0 and uncached < threshold:
            plan.reason = "conditional"
            return plan
        if not prefill:
            plan.reason = "no-prefill-worker"
            return plan
        pc = [Candidate(e.url, inflight_prefill_blocks=self.inflight_prefill_blocks.get(e.url, 0)) for e in prefill]
        pd = self.router.route_prefill(hashes, pc, n, record=not dry_run)
        plan.prefill = self.pool.workers[pd.worker_id]
        plan.prefill_decision = pd
        plan.reason = "disagg"
        return plan

    def explain(self, prompt_ids: list[int]) -> dict:
        plan = self.plan(prompt_ids, dry_run=True)

        def stage(d: Decision | None, chosen: WorkerEntry | None) -> dict | None:
            if d is None:
                return {"chosen": chosen.url, "workers": []} if chosen is not None else None
            return {"chosen": d.worker_id, "cached_ratio": d.cached_ratio,
                    "workers": [{"worker": s.worker_id, "overlap_blocks": s.overlap_blocks, "load": s.load,
                                 "cost": s.cost} for s in d.scores]}

        return {"prompt_tokens": len(prompt_ids), "prompt_blocks": plan.prompt_blocks, "mode": self.router.mode,
                "path": plan.reason, "prefill": stage(plan.prefill_decision, plan.prefill),
                "decode": stage(plan.decode_decision, plan.decode)}
