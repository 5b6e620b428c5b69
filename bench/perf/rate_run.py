"""One constant-rate `pdserve bench profile` run against a server, with the CPU its frontend
process used meanwhile: what the peer and control-plane benchmarks measure at each rate."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from bench.perf.errors import PerfError
from bench.perf.frontend_overhead import MODEL_NAME, cpu_by_process, cpu_by_role, processes, run_client
from bench.perf.servers import pdserve


def rate_cmd(url: str, tokenizer: str, out: Path, rate: float, n: int, isl: int, osl: int) -> list[str]:
    return [*pdserve("bench", "profile"), "-m", MODEL_NAME, "--tokenizer", tokenizer, "--endpoint-type", "chat",
            "-u", url, "--isl", str(isl), "--osl", str(osl), "--streaming", "--extra-inputs", "ignore_eos:true",
            "--request-rate", f"{rate:g}", "--arrival-pattern", "constant", "--num-requests", str(n),
            "--ui-type", "none", "--artifact-dir", str(out), "--no-plots", "--random-seed", "0"]


def rate_run(url: str, roots: dict[int, str], tokenizer: str, out: Path, rate: float, seconds: float, isl: int,
             osl: int, timeout: float) -> dict[str, Any]:
    """`rate` requests/s for `seconds`: achieved rate, errors, sustained (>= 95% of the target,
    every request done, no errors), the frontend's CPU per request, latency p50s and the route
    stage (pdserve's own per-request timing) p50/p99; `failed` when the client failed."""
    n = max(1, int(rate * seconds))
    procs = processes(roots)
    before, t0 = cpu_by_process(procs), time.monotonic()
    try:
        doc = run_client(rate_cmd(url, tokenizer, out, rate, n, isl, osl), out, timeout)
    except (PerfError, subprocess.TimeoutExpired) as exc:
        return {"target": rate, "failed": str(exc)[:400]}
    cpu = cpu_by_role(procs, before, cpu_by_process(procs)).get("frontend", 0.0)

    def stat(tag: str, s: str = "avg") -> Any:
        return (doc.get(tag) or {}).get(s)

    done = stat("request_count") or 0
    achieved = stat("request_throughput") or 0.0
    errors = stat("error_request_count") or 0
    return {"target": rate, "requests": done, "achieved": achieved, "errors": errors,
            "sustained": achieved >= 0.95 * rate and not errors and done >= n,
            "frontend_cpu_s": cpu, "frontend_cpu_ms_per_request": round(1000 * cpu / done, 3) if done else None,
            "osl_avg": stat("output_sequence_length"), "itl_p50_ms": stat("inter_token_latency", "p50"),
            "ttft_p50_ms": stat("time_to_first_token", "p50"), "route_ms_p50": stat("server_stage_route", "p50"),
            "route_ms_p99": stat("server_stage_route", "p99"), "wall_s": round(time.monotonic() - t0, 1)}
