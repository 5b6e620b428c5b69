"""`pdserve sim`: the cluster simulator, offline (a virtual clock, no processes).

    pdserve sim --mode disagg --prefill 64 --decode 16 --sim-system h100_sxm \\
        --sim-model meta-llama/Llama-3.1-8B-Instruct --network rdma \\
        --isl 4000 --osl 200 --request-rate 50 --num-requests 10000 --artifact-dir artifacts/sim

The workload takes `pdserve bench profile`'s flags (synthetic or `--input-file` trace), the
cluster `pdserve up`'s (`--mode --workers --prefill --decode`, the router flags,
`--max-concurrent-requests`, engine options), the step times one of: `--sim-system` +
`--sim-model` (the planner's model), `--sim-profile FILE` (pdserve.profile/1) or
`--sim-step-model`. `--write-profile FILE` writes the planner's profile and exits.
`add_command` is found through the entry point group `pdserve.commands`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from bench.errors import BenchError
from bench.sim.flags import ENGINE_FLAGS, engine_dest

def add_command(sub: argparse._SubParsersAction) -> None:
    from bench.loadgen.config import add_profile_arguments
    from serve import flags

    s = sub.add_parser("sim", help="simulate a cluster offline (virtual clock, the real router)",
                       description=__doc__.split("\n\n")[0] + " Writes bench profile's artifacts, marked simulated.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_arguments(s)
    for action in s._actions:  # no server: the model name is only a label here
        if action.dest == "model":
            action.required = False
            action.default = "sim"
    c = s.add_argument_group("simulated cluster")
    c.add_argument("--mode", choices=["agg", "disagg"], default="agg")
    c.add_argument("--workers", dest="agg_workers", type=int, default=1,
                   help="agg mode: aggregated workers (default: 1)")
    c.add_argument("--prefill", type=int, default=1, help="disagg mode: prefill workers (default: 1)")
    c.add_argument("--decode", type=int, default=1, help="disagg mode: decode workers (default: 1)")
    flags.add_router(c)
    c.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="the frontend's admission: requests served at once (default: 512)")
    c.add_argument("--max-queued-requests", type=int, default=512,
                   help="the frontend's admission queue; beyond it, 429 (default: 512)")
    c.add_argument("--poll-interval", type=float, default=1.0, help="the frontend's load polls, s (default: 1)")
    c.add_argument("--max-prefills-per-worker", type=int, default=0,
                   help="the frontend's prefill gate: split requests beyond N per prefill worker wait, oldest "
                        "first, for one with room; past --prefill-timeout their decode worker prefills "
                        "(default: 0, none)")
    e = s.add_argument_group("simulated engines (vLLM's flags, as `pdserve worker --engine sim`)")
    for flag, kind in ENGINE_FLAGS:
        e.add_argument(flag, dest=engine_dest(flag), type=kind, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache per worker when --num-gpu-blocks is not given (default: the planner's free "
                        "memory with --sim-system, else 1)")
    m = s.add_argument_group("step times from the planner's model")
    m.add_argument("--sim-system", default=None, help="a planner system (h100_sxm, h200_sxm, ...)")
    m.add_argument("--sim-model", default="meta-llama/Llama-3.1-8B-Instruct",
                   help="with --sim-system: the model (a planner model name or HF config dir)")
    m.add_argument("--tp", type=int, default=1, help="with --sim-system: tensor parallelism per worker")
    m.add_argument("--network", choices=["rdma", "tcp"], default=None,
                   help="with --sim-system: the KV link (bandwidth of that network); default: none (instant)")
    m.add_argument("--write-profile", default=None, metavar="FILE",
                   help="write the planner's pdserve.profile/1 for --sim-system/--sim-model and exit")
    o = s.add_argument_group("run")
    o.add_argument("--kill", action="append", default=[], metavar="T:ROLE:N",
                   help="at simulated second T, kill N workers of ROLE (repeatable)")
    o.add_argument("--series-interval", type=float, default=5.0,
                   help="simulated seconds between sim_series.jsonl rows (default: 5)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from bench.loadgen.config import config_from_args
    from bench.sim.options import spec_from_args, write_profile

    try:
        if args.write_profile:
            path = write_profile(args)
            print(f"written: {path}")
            return 0
        if args.artifact_dir is None:
            args.artifact_dir = "artifacts/sim"
        cfg = config_from_args(args, "pdserve sim " + shlex.join(sys.argv[2:]))
        spec = spec_from_args(args)
    except BenchError as e:
        print(f"pdserve sim: error: {e}", file=sys.stderr)
        return 2
    import gc

    from bench.sim.run import simulate, write

    gc.disable()  # millions of small live objects, no cycles that matter: a short-lived process
    result, stats = simulate(cfg, spec, progress=args.ui != "none")
    write(result, stats)
    sim = result.simulation or {}
    print("SIMULATED cluster (pdserve sim): " + json.dumps(spec.describe))
    print(f"{len(result.records)} requests in {sim.get('virtual_seconds')} simulated s, "
          f"{sim.get('wall_seconds')} wall s ({sim.get('requests_per_wall_second')} requests per wall second); "
          f"paths {sim.get('paths')}")
    print(f"artifacts: {Path(cfg.artifact_dir)}")
    return 0
