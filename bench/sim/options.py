"""`pdserve sim`'s flags to a SimSpec: the layout, the engines (parsed by the simulated
worker's own option parser, so the two accept the same engine flags), the step-time
source, the KV link, the frontend's routing and admission settings and the faults."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.sim.flow import Link
from bench.sim.errors import SimError
from bench.sim.flags import ENGINE_FLAGS, engine_dest
from bench.sim.run import Fault, SimSpec
from serve.errors import ConfigError, PdserveError
from serve.frontend.settings import FrontendSettings, conditional_tokens
from serve.sim.config import parse_sim_options

MAX_WORKERS = 100_000


def _engine_argv(args: argparse.Namespace) -> list[str]:
    argv: list[str] = []
    for flag, _ in ENGINE_FLAGS:
        v = getattr(args, engine_dest(flag))
        if v is not None:
            argv += [flag, str(v)]
    for name in ("enable_prefix_caching", "enable_chunked_prefill"):
        v = getattr(args, name)
        if v is not None:
            argv.append(f"--{'' if v else 'no-'}{name.replace('_', '-')}")
    return argv


def _roles(args: argparse.Namespace) -> list[str]:
    if args.mode == "agg":
        if args.agg_workers < 1:
            raise SimError("--workers must be >= 1")
        roles = ["agg"] * args.agg_workers
    else:
        if args.decode < 1 or args.prefill < 0:
            raise SimError("--decode must be >= 1 and --prefill >= 0")
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    if len(roles) > MAX_WORKERS:
        raise SimError(f"at most {MAX_WORKERS} simulated workers")
    return roles


def _faults(args: argparse.Namespace, roles: list[str]) -> list[Fault]:
    out = []
    for text in args.kill:
        parts = text.split(":")
        try:
            t, role, n = float(parts[0]), parts[1], int(parts[2])
            if len(parts) != 3 or t < 0 or n < 1:
                raise ValueError
        except (ValueError, IndexError):
            raise SimError(f"--kill {text!r}: T:ROLE:N, e.g. 60:decode:8") from None
        if role not in set(roles):
            raise SimError(f"--kill {text!r}: no {role} workers in this layout")
        out.append(Fault(t, role, n))
    return out


def _planner_profile_file(args: argparse.Namespace) -> tuple[dict, float]:
    """(the planner's profile document, KV GiB per worker the system leaves free)."""
    from bench.sim.profiles import engine_of, planner_profile

    e = engine_of(args.sim_model, args.sim_system, args.tp, args.engine_kv_cache_dtype or "fp8")
    doc = planner_profile(args.sim_model, args.sim_system, args.tp, args.engine_kv_cache_dtype or "fp8", args.network)
    kv_gib = e.max_tokens_in_kv() * e.kv_bytes_per_token / e.tp / 2**30
    return doc, kv_gib


def write_profile(args: argparse.Namespace) -> Path:
    if not args.sim_system:
        raise SimError("--write-profile needs --sim-system (and --sim-model)")
    doc, _ = _planner_profile_file(args)
    path = Path(args.write_profile)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        raise SimError(f"--write-profile {path}: {exc.strerror or exc}") from None
    return path


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    roles = _roles(args)
    argv = _engine_argv(args)
    kv_gib = args.kv_cache_gib
    describe: dict = {"layout": {r: roles.count(r) for r in dict.fromkeys(roles)}}
    if args.sim_system:
        if args.engine_sim_profile or args.engine_sim_step_model:
            raise SimError("--sim-system, --sim-profile and --sim-step-model: one step-time source")
        doc, free_gib = _planner_profile_file(args)
        path = Path(args.artifact_dir) / "sim_profile.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        argv += ["--sim-profile", str(path)]
        if args.engine_kv_cache_dtype is None:
            argv += ["--kv-cache-dtype", "fp8"]  # the planner's default, and its profile's
        if args.engine_max_num_batched_tokens is None:
            from bench.plan.specs import load_system

            argv += ["--max-num-batched-tokens", str(load_system(args.sim_system).max_num_batched_tokens)]
        kv_gib = kv_gib if kv_gib is not None else free_gib
        describe["step_model"] = {"source": "planner", "system": args.sim_system, "model": args.sim_model,
                                  "tp": args.tp, "network": args.network}
    try:
        opts = parse_sim_options(argv, None, kv_gib if kv_gib is not None else 1.0)
    except ConfigError as exc:
        raise SimError(str(exc)) from None
    bytes_per_block = opts.bytes_per_block
    describe.setdefault("step_model", {"source": opts.step_model.name})
    describe["engine"] = {"max_num_seqs": opts.engine.max_num_seqs, "block_size": opts.engine.block_size,
                          "num_blocks": opts.engine.num_blocks, "max_num_batched_tokens":
                          opts.engine.max_num_batched_tokens, "chunked_prefill": opts.engine.enable_chunked_prefill,
                          "prefix_caching": opts.engine.enable_prefix_caching}
    describe["kv_link"] = {"bandwidth_gbps": opts.kv_bandwidth_gbps, "latency_s": opts.kv_latency_s}
    describe["router"] = args.router_mode
    try:
        settings = FrontendSettings(model="sim", served_model_name=args.model or "sim",
                                    poll_interval_s=args.poll_interval,
                                    max_active_requests=args.max_concurrent_requests,
                                    max_queued_requests=args.max_queued_requests, router_mode=args.router_mode,
                                    kv_overlap_score_weight=args.kv_overlap_score_weight,
                                    router_temperature=args.router_temperature, use_kv_events=not args.no_kv_events,
                                    conditional_disagg_tokens=conditional_tokens(args),
                                    conditional_disagg_auto=args.conditional_disagg_tokens == "auto",
                                    block_size=opts.engine.block_size,
                                    max_prefills_per_worker=args.max_prefills_per_worker,
                                    prefill_timeout_s=args.prefill_timeout)
    except PdserveError as exc:
        raise SimError(str(exc)) from None
    if args.max_concurrent_requests < 1 or args.max_queued_requests < 0 or args.poll_interval <= 0:
        raise SimError("--max-concurrent-requests >= 1, --max-queued-requests >= 0, --poll-interval > 0")
    if args.max_prefills_per_worker < 0 or args.prefill_timeout <= 0:
        raise SimError("--max-prefills-per-worker >= 0 (0: no gate), --prefill-timeout > 0")
    return SimSpec(roles, opts.engine, opts.step_model, bytes_per_block,
                   Link(opts.kv_bandwidth_gbps, opts.kv_latency_s), settings, _faults(args, roles),
                   args.series_interval, describe)
