"""Typed settings of the frontend role (from CLI flags; every default shown in --help)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FrontendSettings:
    model: str
    served_model_name: str
    static_workers: list[str] = field(default_factory=list)
    request_timeout_s: float = 600.0
    worker_read_timeout_s: float = 120.0
    worker_connect_timeout_s: float = 5.0
    # Health polling of workers: a worker failing this many polls in a row leaves rotation.
    poll_interval_s: float = 1.0
    max_poll_failures: int = 3
    retry_after_s: int = 5
    max_body_bytes: int = 4 * 1024 * 1024
    graceful_timeout_s: float = 30.0
    drain_settle_s: float = 0.0
    # Admission (serve.frontend.admission): served at once, waiting for a slot, how long to wait.
    max_active_requests: int = 512
    max_queued_requests: int = 512
    queue_timeout_s: float = 60.0
    # Access (serve.auth): client API keys, the cluster token, paths open without either.
    api_keys: list[str] = field(default_factory=list)
    cluster_token: str | None = None
    auth_exempt_paths: list[str] = field(default_factory=lambda: ["/health", "/live", "/metrics"])
    # Disaggregated serving (used when prefill workers are registered).
    router_mode: str = "kv"
    kv_overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    use_kv_events: bool = True
    conditional_disagg_tokens: int = 0
    prefill_timeout_s: float = 60.0
    block_size: int = 128
