"""`pdserve up --autoscale`: the SLA autoscaler in the launcher's process, acting through the
local actuator (serve/autoscale/local.py) on the launcher's worker processes.

The controller, its observer and its API (`GET /autoscaler`, `/metrics` on
`--autoscale-port`) are the ones `pdserve autoscale` runs, on their own event loop in a
thread of the launcher; the launcher's `start_worker` / `stop_worker` start and stop one
worker process each (real or simulated). Its step model: `--autoscale-profile FILE`; with
`--engine sim`, the simulated workers' own (`--sim-profile` or `--sim-step-model`) unless a
profile is given, divided by `--sim-speedup` as theirs are.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from typing import Any

from serve.autoscale.cli import add_policy_arguments, build_controller, load_profile
from serve.autoscale.errors import AutoscaleError

STOP_TIMEOUT_S = 15.0


def add_arguments(u: argparse.ArgumentParser) -> None:
    g = u.add_argument_group("autoscaling (--autoscale; the flags of `pdserve autoscale`)")
    g.add_argument("--autoscale", action="store_true",
                   help="size the pools to --ttft and --itl: start and stop workers here (the local actuator)")
    add_policy_arguments(g, startup_default=None)  # type: ignore[arg-type]
    g.add_argument("--autoscale-profile", default=None, metavar="FILE",
                   help="the workers' step-time profile (pdserve.profile/1; `pdserve bench calibrate --steps`). "
                        "With --engine sim: the simulated workers' step model by default")
    g.add_argument("--autoscale-port", type=int, default=8090,
                   help="the autoscaler's API: GET /autoscaler, /metrics (default: 8090)")


def settings_from_args(args: argparse.Namespace) -> argparse.Namespace | None:
    """The autoscaler's settings, checked (AutoscaleError: one line), or None without --autoscale."""
    if not getattr(args, "autoscale", False):
        return None
    ns = argparse.Namespace(**vars(args))
    ns.max_num_seqs = args.max_num_seqs or 256
    ns.max_num_batched_tokens = 8192
    if ns.startup_s is None:  # a simulated worker process starts in seconds; a real engine in about a minute
        ns.startup_s = (args.sim_startup_s or 0.0) + 5.0 if args.engine == "sim" else 60.0
    if args.mode == "agg":
        ns.most_workers = min(args.max_workers, args.max_agg)
    else:
        ns.most_workers = min(args.max_workers, args.max_prefill + args.max_decode)
    ns.step, ns.kv_tokens, ns.scale = _step_model(args)
    build_controller(ns, ns.step, ns.kv_tokens, ns.scale)  # every flag checked before anything starts
    return ns


def _step_model(args: argparse.Namespace) -> tuple[Any, int, float]:
    """(StepModel, KV tokens or 0, scale) the autoscaler predicts with."""
    speedup = args.sim_speedup or 1.0
    if args.autoscale_profile:
        step, kv = load_profile(args.autoscale_profile)
        return step, kv, 1.0 / speedup if args.engine == "sim" else 1.0
    if args.engine != "sim":
        raise AutoscaleError("--autoscale with real engines needs --autoscale-profile FILE (the workers' step times: "
                             "`pdserve bench calibrate --steps WORKER_URL --out FILE` on one of them)")
    if args.sim_profile:
        step, kv = load_profile(args.sim_profile)
        return step, kv, 1.0 / speedup
    from serve.sim.timing import parse_step_model

    try:
        return parse_step_model(args.sim_step_model or "constant"), 0, 1.0 / speedup
    except ValueError as exc:
        raise AutoscaleError(str(exc)) from None


class AutoscalerThread:
    """The autoscaler's HTTP server (and with it the controller's loop, its lifespan task) on
    its own event loop in a daemon thread; `stop()` ends both within STOP_TIMEOUT_S."""

    def __init__(self, app: Any, sock: Any, log_level: str) -> None:
        import uvicorn

        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                                    timeout_graceful_shutdown=5))
        self.sock = sock
        self.thread = threading.Thread(target=self._run, name="pdserve-autoscaler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        finally:
            self.sock.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)


def start_autoscaler(launcher: Any, ns: argparse.Namespace, frontend_url: str,
                     workers: dict[str, tuple[str, Any]], sock: Any) -> AutoscalerThread:
    """Start the controller on `launcher`'s workers (`workers`: URL -> (role, Child), the ones
    already serving); its API on `sock` (bound to --autoscale-port before anything started)."""
    from serve.autoscale.live import LiveObserver
    from serve.autoscale.local import LocalActuator
    from serve.autoscale.service import Autoscaler, build_app

    controller = build_controller(ns, ns.step, ns.kv_tokens, ns.scale)
    token = os.environ.get("PDSERVE_CLUSTER_TOKEN")
    observer = LiveObserver([frontend_url], controller.policy.pools, ns.interval, ns.step, token,
                            warmup_s=ns.startup_s)
    actuator = LocalActuator(launcher, workers, drain_timeout_s=60.0 if ns.drain_timeout is None else ns.drain_timeout,
                             start_timeout_s=max(ns.ready_timeout, ns.startup_s * 3), token=token, keep=5000)
    thread = AutoscalerThread(build_app(Autoscaler(controller, observer, ns.dry_run, actuator)), sock, ns.log_level)
    print(f"pdserve up: autoscaler at {thread.url}/autoscaler ({'dry run: recommends only' if ns.dry_run else 'acting'};"
          f" TTFT {ns.ttft:g} ms, ITL {ns.itl:g} ms at p{ns.percentile:g}, every {ns.interval:g} s)", flush=True)
    return thread
