"""`pdserve autoscale` flags, and the process."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from serve.autoscale.errors import AutoscaleError


def add_policy_arguments(p: argparse.ArgumentParser, startup_default: float | None = 60.0) -> None:
    """The controller's flags, shared by `pdserve autoscale` and `pdserve up --autoscale`."""
    p.add_argument("--ttft", type=float, default=None, metavar="MS", help="TTFT target at --percentile (ms)")
    p.add_argument("--itl", "--tpot", dest="itl", type=float, default=None, metavar="MS",
                   help="inter-token latency target at --percentile (ms); --tpot is the same")
    p.add_argument("--percentile", type=float, default=90.0, help="the targets' percentile (default: 90)")
    p.add_argument("--interval", type=float, default=30.0, metavar="S", help="seconds between decisions (default: 30)")
    p.add_argument("--cooldown", type=float, default=60.0, metavar="S",
                   help="seconds between two scale-downs of a pool (default: 60; a scale-down never follows a "
                        "scale-up of the pool within 10 minutes, whatever this is)")
    p.add_argument("--startup-s", type=float, default=startup_default,
                   help="a new worker's start-up time, s" + (f" (default: {startup_default:g})" if startup_default
                                                               else ""))
    for pool, lo, hi in (("prefill", 1, 64), ("decode", 1, 64), ("agg", 1, 64)):
        p.add_argument(f"--min-{pool}", type=int, default=lo, help=f"(default: {lo})")
        p.add_argument(f"--max-{pool}", type=int, default=hi, help=f"(default: {hi})")
    p.add_argument("--max-workers", type=int, default=128, help="all pools together (default: 128)")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="a scale-down waits this long for a worker's streams (and a prefill worker's held "
                        "blocks) before stopping it (default: 60 locally, 330 on Kubernetes: the workers' "
                        "termination grace)")
    p.add_argument("--dry-run", action="store_true", help="recommend only (log, GET /autoscaler, metrics)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frontend", action="append", default=[], metavar="URL", required=True,
                   help="a frontend to observe (repeatable): http://HOST:PORT, or dns+http://NAME:PORT for every "
                        "address NAME resolves to, looked up each interval (as workers find frontends)")
    p.add_argument("--mode", choices=["disagg", "agg"], default="disagg", help="the pools to size (default: disagg)")
    add_policy_arguments(p)
    p.add_argument("--profile", required=True, metavar="FILE",
                   help="the workers' step-time profile (pdserve.profile/1: `pdserve bench calibrate --steps`, or "
                        "`pdserve sim --write-profile` from the planner's model)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the workers' batch (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the workers' step budget (default: 8192)")
    p.add_argument("--actuator", choices=["kubernetes"], default=None,
                   help="act on decisions: kubernetes (the pools' Deployments, through their scale subresource; "
                        "the local actuator is `pdserve up --autoscale`). Without it, --dry-run is required")
    p.add_argument("--namespace", default=None,
                   help="kubernetes: the Deployments' namespace (default: the pod's own, else 'default')")
    for pool in ("prefill", "decode", "agg"):
        p.add_argument(f"--{pool}-deployment", default=f"pdserve-{pool}", metavar="NAME",
                       help=f"kubernetes: the {pool} pool's Deployment (default: pdserve-{pool})")
    p.add_argument("--kubeconfig", default=None, help="kubernetes: a kubeconfig (default: in-cluster credentials)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090, help="its API: GET /autoscaler, /metrics (default: 8090)")
    p.add_argument("--log-level", default="info")


def controller_from_args(args: argparse.Namespace):  # -> (Controller, the profile's StepModel)
    check_policy(args)
    step, kv_tokens = load_profile(args.profile)
    return build_controller(args, step, kv_tokens), step


def load_profile(path: str) -> tuple[Any, int]:
    """(the StepModel of a pdserve.profile/1 file, its KV capacity in tokens or 0)."""
    import json

    from serve.sim.profile import ProfileError, from_dict

    try:
        doc = json.loads(Path(path).read_text())
        step = from_dict(doc, path)
    except OSError as exc:
        raise AutoscaleError(f"--profile {path}: {exc.strerror or exc}") from None
    except (ValueError, ProfileError) as exc:
        raise AutoscaleError(f"--profile {path}: {exc}") from None
    return step, int(doc.get("kv_cache_tokens") or 0)


def build_controller(args: argparse.Namespace, step: Any, kv_tokens: int = 0, scale: float = 1.0):
    """The controller for the policy flags (add_policy_arguments) plus `mode`,
    `max_num_seqs` and `max_num_batched_tokens`, on `step` (times x `scale`)."""
    from serve.autoscale.decide import Bounds, Controller, Policy, Targets
    from serve.autoscale.model import Engine

    check_policy(args)
    engine = Engine(step, args.max_num_seqs, args.max_num_batched_tokens, kv_tokens or 10**9, scale)
    policy = Policy(args.mode, Targets(args.ttft / 1000, args.itl / 1000, args.percentile),
                    Bounds(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode, args.min_agg,
                           args.max_agg, args.max_workers),
                    interval_s=args.interval, cooldown_s=args.cooldown, startup_s=args.startup_s)
    return Controller(policy, {pool: engine for pool in policy.pools})


def check_policy(args: argparse.Namespace) -> None:
    """The policy flags' values (AutoscaleError: one line)."""
    if args.ttft is None or args.itl is None:
        raise AutoscaleError("--ttft MS and --itl MS (the targets) are required")
    if args.ttft <= 0 or args.itl <= 0 or not 0 < args.percentile < 100 or args.interval <= 0:
        raise AutoscaleError("--ttft and --itl must be > 0, --percentile in (0, 100), --interval > 0")
    for pool in ("prefill", "decode", "agg"):
        lo, hi = getattr(args, f"min_{pool}"), getattr(args, f"max_{pool}")
        if not 0 <= lo <= hi:
            raise AutoscaleError(f"--min-{pool} {lo} --max-{pool} {hi}: need 0 <= min <= max")
    if args.drain_timeout is not None and args.drain_timeout < 0:
        raise AutoscaleError("--drain-timeout must be >= 0")
    if args.startup_s is None or args.startup_s < 0:
        raise AutoscaleError("--startup-s must be >= 0")


def namespace_of_pod(default: str = "default") -> str:
    try:
        return Path(SA_NAMESPACE).read_text().strip() or default
    except OSError:
        return default


SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def run(args: argparse.Namespace) -> int:
    from serve import discovery, listen
    from serve.autoscale.live import LiveObserver
    from serve.autoscale.service import Autoscaler, build_app

    token = os.environ.get("PDSERVE_CLUSTER_TOKEN")
    actuator = None
    try:
        if not args.dry_run and args.actuator is None:
            raise AutoscaleError("choose --actuator kubernetes, or --dry-run to recommend only (the local actuator "
                                 "is `pdserve up --autoscale`)")
        controller, step = controller_from_args(args)
        if args.actuator == "kubernetes":
            from serve.autoscale.kube import KubernetesActuator, load_apis

            apps, core = load_apis(args.kubeconfig)
            deployments = {pool: getattr(args, f"{pool}_deployment") for pool in controller.policy.pools}
            actuator = KubernetesActuator(apps, core, args.namespace or namespace_of_pod(), deployments,
                                          drain_timeout_s=330.0 if args.drain_timeout is None else args.drain_timeout,
                                          token=token)
    except AutoscaleError as exc:
        print(f"pdserve autoscale: error: {exc}", file=sys.stderr)
        return 2
    for url in args.frontend:
        try:
            discovery.check(url)
        except ValueError as exc:
            print(f"pdserve autoscale: error: {exc}", file=sys.stderr)
            return 2
    observer = LiveObserver([u.rstrip("/") for u in args.frontend], controller.policy.pools, args.interval, step,
                            token, warmup_s=args.startup_s)
    app = build_app(Autoscaler(controller, observer, args.dry_run, actuator))
    return listen.serve(app, listen.bind(args.host, args.port), log_level=args.log_level, graceful_timeout_s=5.0)
