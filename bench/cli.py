"""`pdserve bench ...` subcommands; each runs on the base install unless it says otherwise
(`bench kv` needs NIXL; `--e2e` also vLLM).

`add_command` is what the serve CLI discovers (entry point group `pdserve.commands`,
`bench = "bench.cli:add_command"`): it adds the `bench` parser with `run` as its default.
A bench.errors.BenchError from any tool is printed as one line,
`pdserve bench <tool>: error: <message>`, exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from bench.errors import BenchError

TOOLS = ("profile", "sweep", "compare", "fake-server", "loadgen-vs-aiperf", "calibrate", "compare-plan", "kv", "soak",
         "engine-memory", "ttft-agreement", "first-token", "frontend-overhead")


def add_command(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to the `pdserve` subcommands."""
    b = sub.add_parser("bench", help="load generator (profile, sweep, compare, fake-server); KV transfer benchmarks (kv)")
    b.set_defaults(run=run)
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCH")
    kv = bsub.add_parser(
        "kv", help="KV transfer paths: NIXL READ/WRITE vs memcpy; --e2e: pdserve push vs pull vs vLLM NixlConnector; "
              "--gpu: NIXL with GPU memory",
        description="Without options: the micro benchmark (two processes, NIXL READ and WRITE over block sizes "
                    "16 KiB to 2 MiB and each transport that works here, against memcpy; writes bench_kv.json). "
                    "With --e2e: the same prompt lengths through pdserve's connector in push and pull mode and "
                    "vLLM's NixlConnector in bf16 and fp8, 5 repeats each (writes bench_kv_e2e.json).")
    kv.add_argument("--e2e", action="store_true", help="end-to-end comparison with real engines (needs vLLM)")
    kv.add_argument("--gpu", nargs="*", metavar="CASE", default=None,
                    help="NIXL between GPU and host memory, no vLLM (cases: vram-vram vram-dram dram-vram dram-dram; "
                         "default: the first three); writes bench_kv_gpu.json")
    kv.add_argument("--out", default="artifacts/bench_kv", help="output folder (default: artifacts/bench_kv)")
    kv.add_argument("--total-mib", type=int, default=256, help="MiB moved per micro case (default: 256)")
    kv.add_argument("--transports", nargs="+", default=["shm", "tcp"], choices=["shm", "tcp", "rdma"],
                    help="UCX profiles for the micro benchmark (default: shm tcp)")
    kv.add_argument("--repeats", type=int, default=None,
                    help="--e2e: passes over the prompt set (default: 5); --gpu: passes per case (default: 5)")
    kv.add_argument("--impls", nargs="+", default=["push", "pull", "nixl"], choices=["push", "pull", "pdserve", "nixl", "ucxx"],
                    help="--e2e: what to run: push, pull (pdserve's connector in that mode, one pair of engines, "
                         "requests alternating), pdserve (the same, the worker's own mode), nixl (vLLM's "
                         "NixlConnector) (default: push pull nixl); without --e2e, ucxx adds raw UCX through UCXX "
                         "(`make ucxx`) to the micro benchmark")
    kv.add_argument("--kinds", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                    help="--e2e: KV dtypes to run (default: bf16 fp8)")
    _add_tool_parsers(bsub)


def _add_tool_parsers(bsub: argparse._SubParsersAction) -> None:
    from bench.loadgen.config import add_profile_arguments
    from bench.testing import fake_server

    prof = bsub.add_parser(
        "profile", help="load-test an OpenAI-compatible endpoint (AIPerf-compatible flags and artifacts)",
        description="Send synthetic or trace requests to an OpenAI-compatible endpoint and measure TTFT, ITL (TPOT), "
                    "latency and throughput. Flags follow `aiperf profile`; artifacts follow AIPerf's layout "
                    "(profile_export.jsonl, profile_export_aiperf.json/.csv) plus PNG plots.")
    add_profile_arguments(prof)
    prof.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    cmp_ = bsub.add_parser("compare", help="two profile runs side by side (ours or AIPerf's)")
    cmp_.add_argument("a", help="artifact dir or profile_export_aiperf.json")
    cmp_.add_argument("b", help="artifact dir or profile_export_aiperf.json")
    sw = bsub.add_parser("sweep", help="profile at several concurrencies; Pareto table + PNG of tokens/s/GPU vs /user")
    add_profile_arguments(sw)
    sw.add_argument("--concurrencies", type=int, nargs="+", required=True, metavar="C",
                    help="concurrencies to run, e.g. 1 2 4 8")
    sw.add_argument("--gpus", type=int, default=1, help="GPUs (or engines) serving, for tokens/s/GPU (default: 1)")
    sw.add_argument("--requests-per-concurrency", type=int, default=None,
                    help="requests per run = C x this (default: --num-requests, else 10 x C)")
    fake_server.add_parser(bsub)
    from bench.perf.soak import add_parser as add_soak_parser

    add_soak_parser(bsub)
    from bench.perf.engine_memory import add_parser as add_engine_memory_parser

    add_engine_memory_parser(bsub)
    from bench.perf.ttft_agreement import add_parser as add_ttft_agreement_parser

    add_ttft_agreement_parser(bsub)
    from bench.perf.first_token import add_parser as add_first_token_parser

    add_first_token_parser(bsub)
    from bench.perf.frontend_overhead import add_parser as add_frontend_overhead_parser

    add_frontend_overhead_parser(bsub)
    from bench.plan.cli import add_bench_parsers

    add_bench_parsers(bsub)
    vs = bsub.add_parser("loadgen-vs-aiperf", help="our load generator vs AIPerf: CPU per request, max rate, agreement",
                         description="Side by side on the fake server: CPU-seconds per request at one fixed rate, the "
                                     "highest sustained rate of each, and TTFT/ITL p50 agreement. Needs AIPerf "
                                     "(`make aiperf`). Writes <out>/bench_loadgen.json.")
    vs.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf", help="aiperf executable (default: .venv-aiperf/bin/aiperf)")
    vs.add_argument("--out", default="artifacts/bench_loadgen", help="output folder (default: artifacts/bench_loadgen)")
    vs.add_argument("--cpu-rate", type=float, default=100.0, help="request rate of the CPU comparison (default: 100)")
    vs.add_argument("--cpu-requests", type=int, default=1500, help="requests of the CPU comparison (default: 1500)")
    vs.add_argument("--rates", type=float, nargs="+", default=[1000, 2000, 3000, 4000, 6000, 8000, 10000],
                    help="rates tried for pdserve, rising (default: 1000 2000 3000 4000 6000 8000 10000)")
    vs.add_argument("--aiperf-rates", type=float, nargs="+", default=[300, 500, 700, 800, 900, 1000, 1400],
                    help="rates tried for AIPerf, rising (default: 300 500 700 800 900 1000 1400)")
    vs.add_argument("--seconds", type=float, default=6.0, help="length of each max-rate run (default: 6)")


def _loadgen(args: argparse.Namespace) -> int:
    import shlex

    if args.bench_command == "fake-server":
        from bench.testing import fake_server

        return fake_server.run(args)
    if args.bench_command == "loadgen-vs-aiperf":
        from bench.loadgen.vs_aiperf import run as run_vs

        run_vs(args.aiperf, args.out, args.cpu_rate, args.cpu_requests, args.rates, args.aiperf_rates, args.seconds)
        return 0
    if args.bench_command == "compare":
        from bench.loadgen.compare import run as run_compare

        return run_compare(args.a, args.b)
    from bench.loadgen.config import config_from_args

    cfg = config_from_args(args, "pdserve " + shlex.join(sys.argv[1:]))
    if args.bench_command == "sweep":
        from bench.loadgen.sweep import run as run_sweep

        return run_sweep(cfg, args.concurrencies, args.gpus, args.requests_per_concurrency)
    from bench.loadgen.export import write_artifacts
    from bench.loadgen.profile import run as run_profile

    result = run_profile(cfg)
    write_artifacts(result, plots=not args.no_plots)
    return 130 if result.was_cancelled else 0


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.bench_command
    if cmd in ("calibrate", "compare-plan"):
        from bench.plan.cli import run_bench

        return run_bench(args)
    if cmd in ("profile", "compare", "sweep", "fake-server", "loadgen-vs-aiperf"):
        return _loadgen(args)
    if cmd == "soak":
        from bench.perf.soak import run as run_soak

        return run_soak(args)
    if cmd == "engine-memory":
        from bench.perf.engine_memory import run as run_engine_memory

        return run_engine_memory(args)
    if cmd == "first-token":
        from bench.perf.first_token import run as run_first_token

        return run_first_token(args)
    if cmd == "frontend-overhead":
        from bench.perf.frontend_overhead import run_cli as run_frontend_overhead

        return run_frontend_overhead(args)
    if cmd == "ttft-agreement":
        from bench.perf.ttft_agreement import run as run_ttft_agreement

        return run_ttft_agreement(args)
    if args.gpu is not None:
        from bench.perf.kv.gpu import run as run_gpu

        res = run_gpu(args.out, args.total_mib, args.gpu or ["vram-vram", "vram-dram", "dram-vram"], args.repeats or 5)
        return 0 if res["cases"] else 1
    if args.e2e:
        from bench.perf.kv.e2e import run as run_e2e

        if "ucxx" in args.impls:
            raise BenchError("--impls ucxx is a micro benchmark path (raw UCX); drop --e2e")
        run_e2e(args.out, args.repeats or 5, tuple(args.impls), tuple(args.kinds))
    else:
        from bench.perf.kv.micro import run as run_micro

        run_micro(args.out, args.total_mib, args.transports, args.repeats or 5,
                  tuple(i for i in args.impls if i == "ucxx"))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the `pdserve bench` tool `args.bench_command` names; its exit status."""
    cmd = getattr(args, "bench_command", None)
    if cmd not in TOOLS:
        print(f"pdserve bench: error: usage: pdserve bench {'|'.join(TOOLS)} ...", file=sys.stderr)
        return 2
    _stop_on_sigterm()
    try:
        return _dispatch(args)
    except BenchError as e:
        print(f"pdserve bench {cmd}: error: {e}", file=sys.stderr)
        return 2


def _stop_on_sigterm() -> None:
    """SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, so each benchmark's `finally` stops
    the servers it started (by default Python dies at once and leaves them running)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
