"""Studies run on the offline simulator (each one `pdserve sim` run per row, in this process):

    python -m bench.sim.studies speed   [--out DIR]   simulated requests per wall second at
                                                      64, 256 and 1,000 workers (--requests each)
    python -m bench.sim.studies routing [--out DIR]   64 prefill + 16 decode workers, a multi-turn
                                                      trace with shared prefixes: cached-token
                                                      ratio and TTFT p50/p90 for kv, round-robin
                                                      and random, and the same with 8 decode
                                                      workers lost at mid-run

    python -m bench.sim.studies conditional [--out DIR]
                                                      4 prefill + 4 decode workers, a mixed trace
                                                      (half short chats, half long documents):
                                                      TTFT, time to second token and output
                                                      tokens/s per GPU for always split, a fixed
                                                      threshold and --conditional-disagg-tokens
                                                      auto, on a TCP-class (1 GB/s) and an
                                                      RDMA-class link

Each writes `study_<name>.json` and prints its table. Every number is SIMULATED (H100, Llama
3.1 8B, fp8 KV, RDMA-class link, from the planner's model).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

COMMON = ["--sim-system", "h100_sxm", "--sim-model", "meta-llama/Llama-3.1-8B-Instruct", "--network", "rdma",
          "--max-model-len", "32768",
          "--max-concurrent-requests", "100000", "--max-queued-requests", "100000", "--ui-type", "none"]


def _run(argv: list[str], out: Path) -> tuple[dict[str, Any], dict[str, Any], float]:
    """One simulation: (its profile_export_aiperf.json, sim_workers.json, wall seconds)."""
    from bench.loadgen.config import config_from_args
    from bench.sim.cli import add_command
    from bench.sim.options import spec_from_args
    from bench.sim.run import simulate, write

    sub = argparse.ArgumentParser(prog="pdserve").add_subparsers()
    add_command(sub)
    args = sub.choices["sim"].parse_args([*COMMON, *argv, "--artifact-dir", str(out)])
    cfg = config_from_args(args, "pdserve sim " + " ".join(argv))
    gc.collect()  # the previous run's cluster (its cycles) goes first: the collector is off
    t0 = time.monotonic()
    result, stats = simulate(cfg, spec_from_args(args), progress=False)
    wall = time.monotonic() - t0
    with contextlib.redirect_stdout(io.StringIO()):  # each run's console table: in its artifact dir
        write(result, stats)
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    return doc, stats["workers"], wall


def speed(out: Path, requests: int) -> dict[str, Any]:
    rows = {}
    for workers in (64, 256, 1000):
        p, d = workers // 4, workers - workers // 4
        argv = ["--mode", "disagg", "--prefill", str(p), "--decode", str(d), "--isl", "1000", "--isl-stddev", "300",
                "--osl", "100", "--osl-stddev", "30", "--request-rate", str(5 * workers), "--num-requests",
                str(requests)]
        doc, _, wall = _run(argv, out / f"speed-{workers}")
        rows[workers] = {"layout": f"{p}P+{d}D", "requests": requests, "wall_s": round(wall, 1),
                         "requests_per_wall_s": round(requests / wall, 1),
                         "simulated_s": doc["simulation"]["virtual_seconds"], "argv": argv}
        print(f"{workers:>5} workers ({p}P+{d}D): {requests} requests in {wall:.1f} s wall "
              f"({requests / wall:,.0f} simulated requests per wall second)", flush=True)
    return rows


def routing(out: Path, requests: int) -> dict[str, Any]:
    trace = ["--mode", "disagg", "--prefill", "64", "--decode", "16", "--num-prefix-prompts", "32",
             "--prefix-prompt-length", "2000", "--isl", "2500", "--isl-stddev", "500", "--osl", "150",
             "--osl-stddev", "50", "--conversation-turn-mean", "3", "--conversation-turn-delay-mean", "2000",
             "--request-rate", "20", "--num-requests", str(requests), "--random-seed", "5"]
    rows = {}
    first = None
    for lost in (False, True):
        for mode in ("kv", "round-robin", "random"):
            argv = [*trace, "--router-mode", mode]
            if lost:
                argv += ["--kill", f"{(first or 60.0) / 2:.1f}:decode:8"]
            doc, workers, wall = _run(argv, out / f"routing-{mode}{'-lost8' if lost else ''}")
            if first is None:
                first = doc["benchmark_duration"]["avg"]
            pre = [w for w in workers.values() if w["role"] == "prefill"]
            cached = sum(w["prompt_tokens_cached"] for w in pre)
            computed = sum(w["prompt_tokens_computed"] for w in pre)
            ttft = doc["time_to_first_token"]
            key = f"{mode}{' (8 decode lost at mid-run)' if lost else ''}"
            rows[key] = {"cached_token_ratio": round(cached / max(1, cached + computed), 4),
                         "ttft_p50_ms": round(ttft["p50"], 1), "ttft_p90_ms": round(ttft["p90"], 1),
                         "errors": doc.get("error_request_count", {}).get("avg", 0),
                         "requests": doc["request_count"]["avg"], "wall_s": round(wall, 1), "argv": argv}
            r = rows[key]
            print(f"{key:<40} cached {r['cached_token_ratio']:.3f}  TTFT p50 {r['ttft_p50_ms']:>8.1f} ms  "
                  f"p90 {r['ttft_p90_ms']:>8.1f} ms  errors {r['errors']:.0f}", flush=True)
    return rows


def mixed_trace(path: Path, requests: int, rate: float, seed: int = 11) -> None:
    """Half short chats (ISL ~300), half long documents (ISL ~8,000), OSL ~200, Poisson
    arrivals at `rate`/s: a Mooncake-style JSONL trace (no shared prefixes)."""
    import random

    rng = random.Random(seed)
    t = 0.0
    with path.open("w") as f:
        for i in range(requests):
            t += rng.expovariate(rate)
            isl = max(32, int(rng.gauss(300, 100))) if i % 2 == 0 else max(2048, int(rng.gauss(8000, 1500)))
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": isl,
                                "output_length": max(16, int(rng.gauss(200, 50)))}) + "\n")


LINKS = {"tcp-class (1 GB/s, 1 ms per READ)": ["--sim-kv-bandwidth-gbps", "1", "--sim-kv-latency-ms", "1"],
         "rdma-class (45 GB/s, 0.05 ms per READ)": ["--sim-kv-bandwidth-gbps", "45", "--sim-kv-latency-ms", "0.05"]}
POLICIES = {"always split": "0", "fixed threshold 1024": "1024", "auto": "auto"}


def conditional(out: Path, requests: int) -> dict[str, Any]:
    trace = out / "mixed_trace.jsonl"
    mixed_trace(trace, requests, rate=14.0)
    layout = ["--mode", "disagg", "--prefill", "4", "--decode", "4"]
    gpus = 8
    rows = {}
    for link, link_argv in LINKS.items():
        for policy, value in POLICIES.items():
            argv = [*layout, *link_argv, "--input-file", str(trace), "--fixed-schedule",
                    "--conditional-disagg-tokens", value]
            name = f"conditional-{link.split()[0]}-{value}"
            doc, workers, wall = _run(argv, out / name)
            paths = doc["simulation"].get("paths", {})
            ttft, ttst, itl = doc["time_to_first_token"], doc["time_to_second_token"], doc["inter_token_latency"]
            key = f"{link}: {policy}"
            rows[key] = {"ttft_p50_ms": round(ttft["p50"], 1), "ttft_p90_ms": round(ttft["p90"], 1),
                         "ttst_p50_ms": round(ttst["p50"], 1), "ttst_p90_ms": round(ttst["p90"], 1),
                         "itl_p90_ms": round(itl["p90"], 2),
                         "output_tps_per_gpu": round(doc["output_token_throughput"]["avg"] / gpus, 1),
                         "split_share": round(paths.get("disagg", 0) / max(1, sum(paths.values())), 3),
                         "errors": doc.get("error_request_count", {}).get("avg", 0),
                         "requests": doc["request_count"]["avg"], "wall_s": round(wall, 1), "argv": argv}
            r = rows[key]
            r.update(_by_class(out / name / "profile_export.jsonl"))
            print(f"{key:<60} TTFT p50 {r['ttft_p50_ms']:>7.1f} p90 {r['ttft_p90_ms']:>7.1f} ms  TTST p50 "
                  f"{r['ttst_p50_ms']:>7.1f} p90 {r['ttst_p90_ms']:>7.1f} ms  ITL p90 {r['itl_p90_ms']:>6.2f} ms  "
                  f"{r['output_tps_per_gpu']:>7.1f} tok/s/GPU  split {r['split_share']:.2f}", flush=True)
            print(f"{'':<60} short chats: TTFT p50 {r['short']['ttft_p50_ms']:>7.1f} p90 {r['short']['ttft_p90_ms']:>7.1f}"
                  f" ms, TTST p90 {r['short']['ttst_p90_ms']:>7.1f} ms; long documents: TTFT p50 "
                  f"{r['long']['ttft_p50_ms']:>7.1f} p90 {r['long']['ttft_p90_ms']:>7.1f} ms, TTST p90 "
                  f"{r['long']['ttst_p90_ms']:>7.1f} ms", flush=True)
    return rows


def _by_class(records: Path) -> dict[str, Any]:
    """TTFT and time to second token p50/p90 of the short (ISL < 2,000) and the long requests
    apart: the mixed trace's percentiles over both fall between the two modes."""
    import statistics

    got: dict[str, dict[str, list[float]]] = {"short": {"ttft": [], "ttst": []}, "long": {"ttft": [], "ttst": []}}
    for line in records.read_text().splitlines():
        m = json.loads(line).get("metrics") or {}
        if "time_to_first_token" not in m:
            continue
        c = got["short" if m["input_sequence_length"]["value"] < 2000 else "long"]
        c["ttft"].append(m["time_to_first_token"]["value"])
        if "time_to_second_token" in m:
            c["ttst"].append(m["time_to_second_token"]["value"])

    def q(v: list[float], p: int) -> float:
        return round(statistics.quantiles(v, n=100, method="inclusive")[p - 1], 1) if len(v) > 1 else float("nan")

    return {k: {f"{m}_p{p}_ms": q(v[m], p) for m in ("ttft", "ttst") for p in (50, 90)} for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim.studies", description=__doc__.split("\n\n")[0])
    ap.add_argument("study", choices=["speed", "routing", "conditional"])
    ap.add_argument("--out", default="artifacts/sim_studies")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per run (default: speed 100000, routing 20000, conditional 4000)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gc.disable()
    print(f"SIMULATED study {args.study!r} (pdserve sim; planner step times, H100, Llama 3.1 8B)", flush=True)
    if args.study == "speed":
        rows = speed(out, args.requests or 100_000)
    elif args.study == "routing":
        rows = routing(out, args.requests or 20_000)
    else:
        rows = conditional(out, args.requests or 4_000)
    (out / f"study_{args.study}.json").write_text(json.dumps({"simulated": True, "rows": rows}, indent=1) + "\n")
    print(f"written: {out / f'study_{args.study}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
