"""The worker's Prometheus metrics: `pdserve_worker_*` per role, and the KV connector's
`pdserve_kv_*` (defined in `kvtransfer.metrics`, so a simulated worker exports the same)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtransfer.metrics import KvMetrics


STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_worker_requests", "Generate requests by outcome", ["role", "outcome"],
                                registry=r)
        self.active = Gauge("pdserve_worker_active_requests", "Requests in this worker", ["role"], registry=r)
        self.kv_usage = Gauge("pdserve_worker_kv_usage_ratio", "KV cache usage (0-1)", ["role"], registry=r)
        self.queue = Gauge("pdserve_worker_queued_requests", "Requests waiting in the scheduler", ["role"], registry=r)
        self.tokens = Counter("pdserve_worker_generated_tokens", "Output tokens generated", ["role"], registry=r)
        self.step_seconds = Histogram("pdserve_worker_step_seconds", "Engine step time (schedule, execute, update)",
                                      ["role"], buckets=STEP_BUCKETS, registry=r)
        self.kv = KvMetrics(r)

    @property
    def held_blocks_now(self) -> int:
        """KV blocks a prefill worker holds for remote decodes (what a drain waits for)."""
        return self.kv.held_blocks_now

    def observe_kv(self, stats: object) -> None:
        """Fold one kvtransfer stats report into the metrics."""
        self.kv.observe(stats)
