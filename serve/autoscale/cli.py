"""`pdserve autoscale` flags, and the process."""

from __future__ import annotations

import argparse
import os
import sys

from serve.autoscale.errors import AutoscaleError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frontend", action="append", default=[], metavar="URL", required=True,
                   help="a frontend to observe (repeatable)")
    p.add_argument("--mode", choices=["disagg", "agg"], default="disagg", help="the pools to size (default: disagg)")
    p.add_argument("--ttft", type=float, required=True, metavar="MS", help="TTFT target at --percentile (ms)")
    p.add_argument("--itl", "--tpot", dest="itl", type=float, required=True, metavar="MS",
                   help="inter-token latency target at --percentile (ms); --tpot is the same")
    p.add_argument("--percentile", type=float, default=90.0, help="the targets' percentile (default: 90)")
    p.add_argument("--interval", type=float, default=30.0, metavar="S", help="seconds between decisions (default: 30)")
    p.add_argument("--cooldown", type=float, default=60.0, metavar="S",
                   help="seconds between two scale-downs of a pool (default: 60; a scale-down never follows a "
                        "scale-up of the pool within 10 minutes, whatever this is)")
    p.add_argument("--startup-s", type=float, default=60.0, help="a new worker's start-up time, s (default: 60)")
    for pool, lo, hi in (("prefill", 1, 64), ("decode", 1, 64), ("agg", 1, 64)):
        p.add_argument(f"--min-{pool}", type=int, default=lo, help=f"(default: {lo})")
        p.add_argument(f"--max-{pool}", type=int, default=hi, help=f"(default: {hi})")
    p.add_argument("--max-workers", type=int, default=128, help="all pools together (default: 128)")
    p.add_argument("--profile", required=True, metavar="FILE",
                   help="the workers' step-time profile (pdserve.profile/1: `pdserve bench calibrate --steps`, or "
                        "`pdserve sim --write-profile` from the planner's model)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the workers' batch (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the workers' step budget (default: 8192)")
    p.add_argument("--dry-run", action="store_true", help="recommend only (log, GET /autoscaler, metrics)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090, help="its API: GET /autoscaler, /metrics (default: 8090)")
    p.add_argument("--log-level", default="info")


def controller_from_args(args: argparse.Namespace):  # -> (Controller, the profile's StepModel)
    import json
    from pathlib import Path

    from serve.autoscale.decide import Bounds, Controller, Policy, Targets
    from serve.autoscale.model import Engine
    from serve.sim.profile import ProfileError, from_dict

    if args.ttft <= 0 or args.itl <= 0 or not 0 < args.percentile < 100 or args.interval <= 0:
        raise AutoscaleError("--ttft and --itl must be > 0, --percentile in (0, 100), --interval > 0")
    for pool in ("prefill", "decode", "agg"):
        lo, hi = getattr(args, f"min_{pool}"), getattr(args, f"max_{pool}")
        if not 0 <= lo <= hi:
            raise AutoscaleError(f"--min-{pool} {lo} --max-{pool} {hi}: need 0 <= min <= max")
    try:
        doc = json.loads(Path(args.profile).read_text())
        step = from_dict(doc, args.profile)
    except OSError as exc:
        raise AutoscaleError(f"--profile {args.profile}: {exc.strerror or exc}") from None
    except (ValueError, ProfileError) as exc:
        raise AutoscaleError(f"--profile {args.profile}: {exc}") from None
    engine = Engine(step, args.max_num_seqs, args.max_num_batched_tokens, int(doc.get("kv_cache_tokens") or 10**9))
    policy = Policy(args.mode, Targets(args.ttft / 1000, args.itl / 1000, args.percentile),
                    Bounds(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode, args.min_agg,
                           args.max_agg, args.max_workers),
                    interval_s=args.interval, cooldown_s=args.cooldown, startup_s=args.startup_s)
    pools = policy.pools
    return Controller(policy, {pool: engine for pool in pools}), step


def run(args: argparse.Namespace) -> int:
    from serve import listen
    from serve.autoscale.live import LiveObserver
    from serve.autoscale.service import Autoscaler, build_app

    try:
        if not args.dry_run:
            raise AutoscaleError("only --dry-run is available: this version recommends (log, GET /autoscaler, "
                                 "pdserve_autoscaler_desired_replicas for an HPA) and has no actuator yet")
        controller, step = controller_from_args(args)
    except AutoscaleError as exc:
        print(f"pdserve autoscale: error: {exc}", file=sys.stderr)
        return 2
    observer = LiveObserver([u.rstrip("/") for u in args.frontend], controller.policy.pools, args.interval, step,
                            os.environ.get("PDSERVE_CLUSTER_TOKEN"), warmup_s=args.startup_s)
    app = build_app(Autoscaler(controller, observer, args.dry_run))
    return listen.serve(app, listen.bind(args.host, args.port), log_level=args.log_level, graceful_timeout_s=5.0)
