"""`pdserve plan ...` (the guide's AIConfigurator call, in our words) and the two bench tools
that tie plans to measurements: `bench calibrate` and `bench compare-plan`.

`add_command` is what the serve CLI discovers (entry point group `pdserve.commands`,
`plan = "bench.plan.cli:add_command"`); `add_bench_parsers` is called by bench.cli.
"""

from __future__ import annotations

import argparse
import sys

from bench.errors import BenchError


def add_command(sub: argparse._SubParsersAction) -> None:
    """Add `plan` to the `pdserve` subcommands; its `run` default runs it."""
    from bench.plan.specs import system_names

    p = sub.add_parser(
        "plan", help="compare aggregated and disaggregated layouts under TTFT/TPOT targets",
        description="Predict every aggregated and disaggregated layout of a model on a system within a GPU budget "
                    "(performance model in bench/plan/perf.py), keep those meeting the TTFT and TPOT targets, rank "
                    "them by output tokens/s per GPU, and write plan.json, agg_best.csv, disagg_best.csv, "
                    "pareto.csv/.png and launch.sh to --save-dir.")
    p.add_argument("--model", "--hf-id", "--hf_id", dest="model", required=True,
                   help="a known model name (with or without its organisation) or a Hugging Face config directory")
    p.add_argument("--system", required=True, metavar="|".join(system_names()),
                   help="GPU system, or cpu-local (this machine, after `pdserve bench calibrate`), or a profile .json")
    p.add_argument("--total-gpus", "--total_gpus", dest="total_gpus", type=int, required=True, help="GPU budget")
    p.add_argument("--isl", type=int, required=True, help="input tokens per request")
    p.add_argument("--osl", type=int, required=True, help="output tokens per request")
    p.add_argument("--ttft", type=float, required=True, help="TTFT target (ms)")
    p.add_argument("--tpot", type=float, required=True, help="TPOT (inter-token latency) target (ms)")
    p.add_argument("--backend", default="vllm", choices=["vllm"], help="serving backend modelled (default: vllm)")
    p.add_argument("--backend-version", "--backend_version", dest="backend_version", default=None,
                   help="accepted for AIConfigurator compatibility; the model is version-independent")
    p.add_argument("--kv-dtype", choices=["fp8", "bf16"], default="bf16",
                   help="KV cache dtype (default: bf16, the model's own, as vLLM's --kv-cache-dtype auto and "
                        "AIConfigurator assume; fp8 halves the KV bytes)")
    p.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16", help="weights and GEMMs (default: bf16)")
    p.add_argument("--network", choices=["rdma", "tcp"], default="rdma", help="KV transfer network (default: rdma)")
    p.add_argument("--roofline-only", action="store_true",
                   help="one set of efficiencies for every GPU system (systems.json's defaults), not each system's "
                        "own measured kernel efficiencies (bench/plan/data/kernels.json)")
    p.add_argument("--save-dir", "--save_dir", dest="save_dir", default="artifacts/plan",
                   help="where plan.json and the tables go (default: artifacts/plan)")
    s = p.add_argument_group("ranking by simulation (bench/plan/simulate.py)")
    s.add_argument("--simulate", action="store_true",
                   help="run the best layouts of each mode through the cluster simulator and rank them by simulated "
                        "goodput per GPU (writes simulated.json)")
    s.add_argument("--simulate-top", type=int, default=5, help="layouts of each mode to simulate (default: 5)")
    s.add_argument("--sim-requests", type=int, default=None,
                   help="requests per simulation (default: 3-20x the layout's concurrency, ~400k output tokens)")
    s.add_argument("--sim-workload", default=None, metavar="'FLAGS'",
                   help="`pdserve bench profile` workload flags for the simulations, e.g. '--isl-stddev 800 "
                        "--request-rate 20 --arrival poisson --num-prefix-prompts 8 --prefix-prompt-length 1000'")
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="simulate a Mooncake trace (replayed on its timestamps) instead of the stated workload")
    p.set_defaults(run=run_plan)


def add_bench_parsers(bsub: argparse._SubParsersAction) -> None:
    c = bsub.add_parser("calibrate", help="fit a system profile (cpu-local) to `bench profile` runs, or a step-time "
                                          "profile to engine step records (--steps)",
                        description="Fit effective compute rate, memory bandwidth and step overhead so the planner's "
                                    "aggregated prediction reproduces the runs' TTFT and ITL p50 (see bench/plan/calibrate.py); "
                                    "with --steps, fit a pdserve.profile/1 step model to workers' engine steps "
                                    "(see bench/sim/stepfit.py).")
    c.add_argument("artifact_dirs", nargs="*", help="artifact dirs of streaming `bench profile` runs (one engine)")
    c.add_argument("--steps", action="append", default=[], metavar="WORKER_URL|FILE",
                   help="engine steps to fit a pdserve.profile/1 to: a worker's URL (its GET /steps; the cluster "
                        "token from PDSERVE_CLUSTER_TOKEN) or a file of step records (repeatable)")
    c.add_argument("--system-name", default="measured", help="--steps: the profile's system name (default: measured)")
    c.add_argument("--tp", type=int, default=1,
                   help="--steps: the tensor parallelism of the workers measured (default: 1); the planner ranks "
                        "layouts of that TP only")
    c.add_argument("--out", default=None, help="profile file (default: cpu-local.json in the pdserve cache; with "
                                               "--steps: artifacts/calibrate/profile.json)")
    c.add_argument("--memory-gib", type=float, default=1.5,
                   help="memory per engine for weights + KV cache (default: 1.5, `pdserve up`'s 1 GiB KV cache plus weights)")
    cp = bsub.add_parser("compare-plan", help="measured TTFT, TPOT and throughput next to a plan's prediction")
    cp.add_argument("plan", help="plan.json (or its --save-dir)")
    cp.add_argument("artifact_dir", help="artifact dir of a `bench profile` run")


def run_plan(args: argparse.Namespace) -> int:
    from bench.plan.report import PlanInputs, plan, summary_text, write

    try:
        doc = plan(PlanInputs(model=args.model, system=args.system, total_gpus=args.total_gpus, isl=args.isl,
                              osl=args.osl, ttft_ms=args.ttft, tpot_ms=args.tpot, backend=args.backend,
                              kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype, network=args.network,
                              roofline_only=args.roofline_only))
        write(doc, args.save_dir)
        print(summary_text(doc))
        print(f"saved: {args.save_dir}/plan.json, agg_best.csv, disagg_best.csv, pareto.csv, pareto.png, launch.sh")
        if args.simulate and doc.winner:
            _simulate(doc, args)
    except BenchError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    return 0 if doc.winner else 1


def _simulate(doc, args: argparse.Namespace) -> None:
    import json
    import time
    from pathlib import Path

    from bench.plan.errors import PlanError
    from bench.plan.simulate import simulate_plan, table

    if args.simulate_top < 1 or (args.sim_requests is not None and args.sim_requests < 1):
        raise PlanError("--simulate-top and --sim-requests must be >= 1")
    if args.trace and not Path(args.trace).is_file():
        raise PlanError(f"--trace {args.trace}: no such file")
    t0 = time.monotonic()
    out = Path(args.save_dir) / "simulated"
    rows = simulate_plan(doc, args.simulate_top, args.sim_requests, args.sim_workload, args.trace, str(out))
    doc_out = {"simulated": True, "ranked_by": "simulated goodput tokens/s per GPU", "targets":
               {"ttft_ms": doc.targets.ttft_ms, "tpot_ms": doc.targets.tpot_ms},
               "workload": {"trace": args.trace, "sim_workload": args.sim_workload}, "layouts": rows,
               "seconds": round(time.monotonic() - t0, 1)}
    (Path(args.save_dir) / "simulated.json").write_text(json.dumps(doc_out, indent=1) + "\n")
    print()
    print(table(rows))
    best = rows[0] if rows else None
    if best:
        closed = doc.winner
        print(f"SIMULATED winner: {best['mode']}: {best['layout']} (closed form: {closed}); "
              f"{len(rows)} simulations in {doc_out['seconds']} s")
    print(f"saved: {args.save_dir}/simulated.json")


def run_bench(args: argparse.Namespace) -> int:
    from bench.plan.calibrate import calibrate, compare_plan
    from bench.plan.errors import PlanError

    try:
        if args.bench_command == "calibrate" and args.steps:
            if args.artifact_dirs:
                raise PlanError("--steps fits engine steps; artifact dirs are for the planner's fit: "
                                "give one or the other")
            import os

            from bench.sim.stepfit import calibrate_steps

            calibrate_steps(args.steps, args.out or "artifacts/calibrate/profile.json",
                            os.environ.get("PDSERVE_CLUSTER_TOKEN"), args.system_name, args.tp)
        elif args.bench_command == "calibrate":
            calibrate(args.artifact_dirs, args.out, args.memory_gib)
        else:
            compare_plan(args.plan, args.artifact_dir)
    except BenchError as e:
        print(f"pdserve bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2
    return 0
