"""Frontend Prometheus metrics, Dynamo-like names under `pdserve_frontend_`.

One registry per frontend instance (no module globals), rendered at GET /metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serve.common.promtext import TextRenderer


def geometric(lo: float, hi: float, ratio: float = 1.09) -> tuple[float, ...]:
    """Bucket bounds from `lo` to at least `hi`, each at most `ratio` times the one before
    (4 significant digits): a quantile read from them is off by less than ratio - 1."""
    out = [lo]
    while out[-1] < hi:
        out.append(float(f"{out[-1] * ratio:.4g}"))
    return tuple(out)


# Fine where latency targets usually sit (TTFT 100 ms - 2 s, ITL 5 - 50 ms): a p90 read from
# the histogram is within 10% there. Coarse elsewhere.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, *geometric(0.1, 2.0), 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, *geometric(0.005, 0.05), 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class FrontendMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_frontend_requests", "Requests by endpoint, model and HTTP status",
                                ["endpoint", "model", "request_type", "status"], registry=r)
        self.inflight = Gauge("pdserve_frontend_inflight_requests", "Requests being served", registry=r)
        self.ttft = Histogram("pdserve_frontend_time_to_first_token_seconds",
                              "Time to first token, from the request's arrival at the frontend (every path)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.stages = Histogram("pdserve_frontend_stage_seconds",
                                "Time to first token by stage (serve/frontend/timing.py: queue, tokenize, route, "
                                "prefill, kv_transfer, decode_first_step, other; a request's stages add up to its TTFT)",
                                ["stage"], buckets=(0.0001, 0.0005, 0.001, 0.0025, *LATENCY_BUCKETS), registry=r)
        self.itl = Histogram("pdserve_frontend_inter_token_latency_seconds", "Time between output tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("pdserve_frontend_request_duration_seconds",
                                  "Whole request duration, from its arrival at the frontend",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.isl = Histogram("pdserve_frontend_input_sequence_tokens", "Prompt tokens per request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.osl = Histogram("pdserve_frontend_output_sequence_tokens", "Output tokens per request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.cached = Counter("pdserve_frontend_cached_tokens", "Prompt tokens served from a prefix cache",
                              registry=r)
        self.prefill_fallbacks = Counter(
            "pdserve_frontend_prefill_fallbacks", "Requests whose prefill ran on the decode worker instead",
            ["reason"], registry=r)
        self.paths = Counter("pdserve_frontend_request_paths",
                             "Requests by path: agg, disagg, conditional (prefill skipped), no-prefill-worker",
                             ["path"], registry=r)
        self.router_decisions = Counter("pdserve_router_decisions", "Routing decisions by stage and worker",
                                        ["stage", "worker"], registry=r)
        self.router_cached_ratio = Histogram(
            "pdserve_router_cached_token_ratio", "Share of the prompt's blocks cached on the chosen prefill worker",
            buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        # The worker's own gauge is pdserve_worker_kv_usage_ratio{role}; this is the frontend's
        # polled copy, one series per worker.
        self.worker_kv_usage = Gauge("pdserve_frontend_worker_kv_usage_ratio", "KV usage per worker (polled)",
                                     ["worker", "role"], registry=r)
        self.worker_active_blocks = Gauge("pdserve_worker_active_blocks", "Active KV blocks per worker (polled)",
                                          ["worker", "role"], registry=r)
        self.workers = Gauge("pdserve_frontend_workers", "Workers in rotation", ["role"], registry=r)
        self.queued = Gauge("pdserve_frontend_queued_requests", "Requests admitted but not yet served "
                            "(reading the body or waiting for a slot)", registry=r)
        self.prefill_held = Gauge("pdserve_frontend_prefill_held_requests", "Split requests waiting in this frontend "
                                  "for a prefill worker with room (--max-prefills-per-worker)", registry=r)
        self.rejected = Counter("pdserve_frontend_rejected_requests", "Requests refused by admission "
                                "(overloaded: 429; queue_timeout: 504)", ["reason"], registry=r)
        self.loop_stalled = Gauge("pdserve_frontend_event_loop_stalled_seconds",
                                  "Seconds this frontend's event loop was stalled since it started (a starved or "
                                  "blocked loop; worker leases do not count this time)", registry=r)
        self._text = TextRenderer(r)

    def render(self) -> bytes:
        """`generate_latest`'s text, rendered faster (serve.common.promtext): scrapers such
        as AIPerf's read this three times a second."""
        return self._text.render()
