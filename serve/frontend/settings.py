"""Typed settings of the frontend role, and the flags of `pdserve frontend` that make them
(every default shown in --help)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from serve import flags
from serve.errors import PdserveError


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
    max_prefills_per_worker: int = 0  # serve.frontend.prefillgate; 0: send each prefill at once
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
    conditional_disagg_auto: bool = False  # split only when the transfer costs less than a local prefill
    prefill_timeout_s: float = 60.0
    first_token_from: str = "prefill"  # "decode": the decode worker regenerates the prefill's token
    block_size: int = 128

    @staticmethod
    def add_arguments(f: argparse.ArgumentParser) -> None:
        f.add_argument("--host", default=flags.DEFAULT_HOST, help="bind address (default: 127.0.0.1; env PDSERVE_HOST)")
        f.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
        f.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # a socket `pdserve up` bound
        f.add_argument("--worker", action="append", default=[], metavar="URL",
                       help="static worker URL (repeatable); workers may also register themselves")
        f.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds a request may take in all (default: 600)")
        f.add_argument("--worker-read-timeout", type=float, default=120.0,
                       help="seconds to wait for the next token from a worker (default: 120)")
        f.add_argument("--graceful-timeout", type=float, default=30.0,
                       help="seconds SIGTERM and `pdserve drain` wait for in-flight requests (default: 30)")
        f.add_argument("--max-concurrent-requests", type=int, default=512,
                       help="requests served at once; more wait in the admission queue (default: 512)")
        f.add_argument("--max-queued-requests", type=int, default=512,
                       help="requests waiting for a slot; beyond that, 429 with Retry-After (default: 512)")
        f.add_argument("--queue-timeout", type=float, default=60.0,
                       help="seconds a request may wait for a slot before a 504 (default: 60)")
        f.add_argument("--max-prefills-per-worker", type=int, default=0, metavar="N",
                       help="prefills this frontend keeps on one prefill worker at once; more wait here, oldest "
                            "first, for a worker with room (one finishing or joining), within --prefill-timeout. "
                            "0 sends each at once to its worker's queue (default: 0)")
        f.add_argument("--api-key", action="append", default=flags.env_list("PDSERVE_API_KEY"), metavar="KEY",
                       help="require `Authorization: Bearer KEY` on the OpenAI endpoints (repeatable; env "
                            "PDSERVE_API_KEY, comma-separated); without it they are open")
        flags.add_tokens(f)
        f.add_argument("--drain-settle", type=float, default=0.0,
                       help="seconds `pdserve drain` keeps serving after leaving readiness, for load balancers "
                            "to notice (default: 0; the Kubernetes manifests use 5)")
        flags.add_router(f)
        flags.add_model(f)
        flags.add_log_level(f)

    @classmethod
    def from_args(cls, args: argparse.Namespace, model: str, served_model_name: str) -> FrontendSettings:
        """Validated settings; `model` is the resolved model directory."""
        if args.graceful_timeout < 0 or args.drain_settle < 0 or args.queue_timeout < 0:
            raise PdserveError("--graceful-timeout, --drain-settle and --queue-timeout must be >= 0")
        if args.max_concurrent_requests < 1 or args.max_queued_requests < 0:
            raise PdserveError("--max-concurrent-requests must be >= 1 and --max-queued-requests >= 0")
        if args.request_timeout <= 0 or args.worker_read_timeout <= 0:
            raise PdserveError("--request-timeout and --worker-read-timeout must be > 0")
        if args.max_prefills_per_worker < 0:
            raise PdserveError(f"--max-prefills-per-worker {args.max_prefills_per_worker}: must be >= 0 (0: no limit)")
        return cls(
            model=model, served_model_name=served_model_name,
            static_workers=list(args.worker), request_timeout_s=args.request_timeout,
            worker_read_timeout_s=args.worker_read_timeout, router_mode=args.router_mode,
            kv_overlap_score_weight=args.kv_overlap_score_weight, router_temperature=args.router_temperature,
            use_kv_events=not args.no_kv_events, conditional_disagg_tokens=conditional_tokens(args),
            conditional_disagg_auto=args.conditional_disagg_tokens == "auto",
            prefill_timeout_s=args.prefill_timeout, first_token_from=args.first_token_from,
            graceful_timeout_s=args.graceful_timeout,
            drain_settle_s=args.drain_settle, api_keys=list(args.api_key), cluster_token=args.cluster_token,
            max_active_requests=args.max_concurrent_requests, max_queued_requests=args.max_queued_requests,
            queue_timeout_s=args.queue_timeout, max_prefills_per_worker=args.max_prefills_per_worker,
            auth_exempt_paths=flags.paths(args.auth_exempt_paths),
        )


def conditional_tokens(args: argparse.Namespace) -> int:
    """`--conditional-disagg-tokens` as a fixed threshold (0 for auto, which has its own setting)."""
    v = args.conditional_disagg_tokens
    return 0 if v == "auto" else int(v)
