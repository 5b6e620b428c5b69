"""`pdserve up`'s settings: its flags, checked, as one object the launcher runs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from serve import flags
from serve.deploy import autoscaled
from serve.errors import PdserveError


@dataclass
class UpSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    advertise_host: str | None = None
    roles: list[str] = field(default_factory=lambda: ["agg"])
    worker_base_port: int = 8100
    model: str | None = None
    served_model_name: str | None = None
    kv_cache_gib: float = 1.0
    ready_timeout_s: float = 180.0
    grace_s: float = 20.0
    log_level: str = "info"
    frontend_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    role_args: dict[str, list[str]] = field(default_factory=dict)  # extra worker flags per role
    engine: str = "vllm"  # vllm | sim
    worker_nice: int = 0  # niceness of every worker process (`--worker-nice`)
    # `--autoscale`: the SLA autoscaler runs in this process with the local actuator; every
    # worker is then its own process (simulated ones too) and registers with the frontend.
    autoscale: argparse.Namespace | None = None

    @staticmethod
    def add_arguments(u: argparse.ArgumentParser) -> None:
        u.add_argument("--host", default=flags.DEFAULT_HOST, help="bind address for every process (default: 127.0.0.1)")
        u.add_argument("--port", type=int, default=8000, help="frontend port (default: 8000)")
        u.add_argument("--advertise-host", default=None, help="host others should dial (default: --host)")
        u.add_argument("--engine", choices=["vllm", "sim"], default="vllm",
                       help="vllm: real engines, one process each; sim: simulated workers (serve.sim), one process "
                            "per role with all of that role's workers (one per worker under --autoscale) (default: vllm)")
        u.add_argument("--sim-step-model", default=None, metavar="MODEL",
                       help="--engine sim: every simulated worker's step model, e.g. constant:0.02 (default: the "
                            "simulated worker's)")
        u.add_argument("--sim-profile", default=None, metavar="FILE",
                       help="--engine sim: step times from a pdserve.profile/1 file (`pdserve sim --write-profile`, "
                            "`pdserve bench calibrate`)")
        u.add_argument("--sim-speedup", type=float, default=None, metavar="X",
                       help="--engine sim: divide modelled step and transfer times by X (leases, polls and "
                            "timeouts stay in wall-clock time)")
        u.add_argument("--sim-startup-s", type=float, default=None, metavar="S",
                       help="--engine sim: each simulated engine's start-up delay")
        u.add_argument("--mode", choices=["agg", "disagg"], default="agg",
                       help="agg: --workers aggregated workers; disagg: --prefill and --decode workers (default: agg)")
        u.add_argument("--workers", type=int, default=1, help="agg mode: number of aggregated workers (default: 1)")
        u.add_argument("--prefill", type=int, default=1, help="disagg mode: number of prefill workers (default: 1)")
        u.add_argument("--decode", type=int, default=1, help="disagg mode: number of decode workers (default: 1)")
        u.add_argument("--kv-lease-seconds", type=float, default=30.0,
                       help="disagg mode: prefill workers' KV lease (default: 30)")
        u.add_argument("--kv-transfer-mode", choices=["auto", "push", "pull"], default=None,
                       help="disagg mode: how decode workers get a prompt's KV: pull (the decode READs the prefill's "
                            "blocks), push (the prefill WRITEs them into the decode's), auto (pull on RDMA, push "
                            "elsewhere; the workers' default)")
        u.add_argument("--kv-cache-dtype", default=None,
                       help="KV cache dtype for every worker, e.g. fp8 (default: model's)")
        u.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="vLLM tensor parallelism of every worker (default: vLLM's, 1)")
        u.add_argument("--max-num-seqs", type=int, default=None,
                       help="vLLM max-num-seqs (batch) of every worker (default: vLLM's)")
        u.add_argument("--prefill-max-num-seqs", type=int, default=None,
                       help="disagg mode: max-num-seqs of prefill workers")
        u.add_argument("--decode-max-num-seqs", type=int, default=None,
                       help="disagg mode: max-num-seqs of decode workers")
        flags.add_router(u)
        u.add_argument("--request-timeout", type=float, default=None, metavar="S",
                       help="the frontend's --request-timeout: seconds a request may take in all (default: the "
                            "frontend's, 600)")
        u.add_argument("--worker-read-timeout", type=float, default=None, metavar="S",
                       help="the frontend's --worker-read-timeout: seconds without a token from a worker before the "
                            "request fails (default: the frontend's, 120)")
        u.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                       help="the frontend's --max-concurrent-requests: requests served at once (default: the "
                            "frontend's, 512)")
        u.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                       help="the frontend's --max-queued-requests: requests waiting for a slot (default: the "
                            "frontend's, 512)")
        u.add_argument("--queue-timeout", type=float, default=None, metavar="S",
                       help="the frontend's --queue-timeout: seconds a request may wait for a slot (default: the "
                            "frontend's, 60)")
        u.add_argument("--max-prefills-per-worker", type=int, default=None, metavar="N",
                       help="the frontend's --max-prefills-per-worker: prefills one prefill worker gets at once, the "
                            "rest wait in the frontend for a worker with room (default: the frontend's, 0: no limit)")
        u.add_argument("--worker-base-port", type=int, default=8100, help="first worker port (default: 8100)")
        u.add_argument("--worker-nice", type=int, default=0, metavar="N",
                       help="run every worker process at niceness N (0-19): on a box shared with the frontend and "
                            "the load generator (a test rig of simulated workers), they keep the CPU they need "
                            "(default: 0)")
        u.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache GiB per worker (default: 1)")
        u.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require `Authorization: Bearer KEY` on the frontend's OpenAI endpoints (repeatable; "
                            "env PDSERVE_API_KEY)")
        u.add_argument("--ready-timeout", type=float, default=180.0,
                       help="seconds to wait for every process to become ready (default: 180)")
        flags.add_model(u)
        flags.add_log_level(u)
        autoscaled.add_arguments(u)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpSettings:
        if not 0 <= args.worker_nice <= 19:
            raise PdserveError(f"--worker-nice {args.worker_nice}: a niceness from 0 to 19")
        if args.kv_cache_gib < 1 or args.kv_cache_gib != int(args.kv_cache_gib):
            raise PdserveError(f"--kv-cache-gib {args.kv_cache_gib:g}: a whole number of GiB >= 1")
        if min(args.workers, args.prefill, args.decode) < 0 or (args.mode == "agg" and args.workers < 1) \
                or (args.mode == "disagg" and args.decode < 1):
            raise PdserveError("need at least one agg worker (agg) or one decode worker (disagg)")
        roles = (["agg"] * args.workers if args.mode == "agg"
                 else ["prefill"] * args.prefill + ["decode"] * args.decode)
        worker_args = ["--kv-lease-seconds", str(args.kv_lease_seconds)] + (
            ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else [])
        if args.kv_transfer_mode is not None:
            if args.engine == "sim" and args.kv_transfer_mode == "push":
                raise PdserveError("--kv-transfer-mode push needs real engines: simulated workers model pull "
                                   "transfers")
            worker_args += ["--kv-transfer-mode", args.kv_transfer_mode]
        for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                            ("--max-num-seqs", args.max_num_seqs)):
            if value is not None:
                if value < 1:
                    raise PdserveError(f"{flag} must be >= 1")
                worker_args += [flag, str(value)]
        for flag, value in (("--sim-step-model", args.sim_step_model), ("--sim-profile", args.sim_profile),
                            ("--sim-speedup", args.sim_speedup), ("--sim-startup-s", args.sim_startup_s)):
            if value is not None:
                if args.engine != "sim":
                    raise PdserveError(f"{flag} needs --engine sim")
                worker_args += [flag, str(value)]
        role_args: dict[str, list[str]] = {}
        for role, value in (("prefill", args.prefill_max_num_seqs), ("decode", args.decode_max_num_seqs)):
            if value is not None:
                if value < 1:
                    raise PdserveError(f"--{role}-max-num-seqs must be >= 1")
                role_args[role] = ["--max-num-seqs", str(value)]
        return cls(host=args.host, port=args.port, advertise_host=args.advertise_host, roles=roles,
                   worker_base_port=args.worker_base_port, model=args.model,
                   served_model_name=args.served_model_name, kv_cache_gib=args.kv_cache_gib,
                   ready_timeout_s=args.ready_timeout, log_level=args.log_level,
                   frontend_args=flags.router_flags(args) + _frontend_passthrough(args),
                   worker_args=worker_args, role_args=role_args,
                   engine=args.engine, worker_nice=args.worker_nice, autoscale=autoscaled.settings_from_args(args))



def _frontend_passthrough(args: argparse.Namespace) -> list[str]:
    """The frontend flags `pdserve up` passes on as given (unset: the frontend's defaults)."""
    out: list[str] = []
    # (flag, value, lowest allowed, whether the lowest itself is allowed)
    for flag, value, lowest, inclusive in (("--request-timeout", args.request_timeout, 0, False),
                                           ("--worker-read-timeout", args.worker_read_timeout, 0, False),
                                           ("--max-concurrent-requests", args.max_concurrent_requests, 1, True),
                                           ("--max-queued-requests", args.max_queued_requests, 0, True),
                                           ("--queue-timeout", args.queue_timeout, 0, True),
                                           ("--max-prefills-per-worker", args.max_prefills_per_worker, 0, True)):
        if value is None:
            continue
        if value < lowest or (value == lowest and not inclusive):
            raise PdserveError(f"{flag} {value:g}: must be {'>=' if inclusive else '>'} {lowest}")
        out += [flag, str(value)]
    return out
