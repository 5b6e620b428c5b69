"""`pdserve bench ...` subcommands. Imported by serve/cli.py; each runs on the base install
unless it says otherwise (`bench kv` needs NIXL; `--e2e` also vLLM)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks: KV transfer paths (kv)")
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCH")
    kv = bsub.add_parser(
        "kv", help="KV transfer paths: NIXL READ/WRITE vs memcpy; --e2e: pdserve connector vs vLLM NixlConnector",
        description="Without options: the micro benchmark (two processes, NIXL READ and WRITE over block sizes "
                    "16 KiB to 2 MiB and each transport that works here, against memcpy; writes bench_kv.json). "
                    "With --e2e: the same prompts through pdserve's connector and vLLM's NixlConnector in bf16 "
                    "and fp8 (writes bench_kv_e2e.json).")
    kv.add_argument("--e2e", action="store_true", help="end-to-end comparison with real engines (needs vLLM)")
    kv.add_argument("--out", default="artifacts/bench_kv", help="output folder (default: artifacts/bench_kv)")
    kv.add_argument("--total-mib", type=int, default=256, help="MiB moved per micro case (default: 256)")
    kv.add_argument("--transports", nargs="+", default=["shm", "tcp"], choices=["shm", "tcp", "rdma"],
                    help="UCX profiles for the micro benchmark (default: shm tcp)")
    kv.add_argument("--repeats", type=int, default=1, help="--e2e: passes over the prompt set (default: 1)")
    kv.add_argument("--impls", nargs="+", default=["pdserve", "nixl"], choices=["pdserve", "nixl"],
                    help="--e2e: connectors to run (default: pdserve nixl)")
    kv.add_argument("--kinds", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                    help="--e2e: KV dtypes to run (default: bf16 fp8)")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "kv":
        if args.e2e:
            from bench.kv.e2e import run as run_e2e

            run_e2e(args.out, args.repeats, tuple(args.impls), tuple(args.kinds))
        else:
            from bench.kv.micro import run as run_micro

            run_micro(args.out, args.total_mib, args.transports)
        return 0
    raise SystemExit("usage: pdserve bench kv [--e2e]")
