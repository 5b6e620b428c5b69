"""One frontend in front of hundreds of simulated workers: registration, load polling and
KV-event subscription at scale, idle and under load.

    python -m bench.perf.control_plane --workers 256 [--rates 20 40 80 ...] [--idle-s 60]
    python -m bench.perf.control_plane --workers 1000 --rates R   (R: 80% of the 256 result)

One `pdserve frontend` process; the workers are simulated (`pdserve worker --engine sim
--replicas K`, `--per-process` of them in each process, half prefill and half decode by
default), each with its own port, lease renewals, `/load` polled by the frontend and its KV
events subscribed to, as real workers have. Every result is labelled SIMULATED.

Phases:
- start-up: how long until every worker is in rotation;
- idle (`--idle-s`): the workers in rotation, sampled every `--sample-s` (a lease lapse
  shows as a dip), and the frontend's CPU per second;
- load: `pdserve bench profile` (disaggregated: prefill then decode, ISL/OSL as given) at
  each rate of `--rates`, rising, until one is not sustained (achieved >= 95% of the target,
  no errors). For each: achieved rate, frontend CPU-ms per request, the route stage of TTFT
  (the routing decision, from the frontend's own per-request timing) p50/p99, TTFT p50, and
  the fewest workers in rotation during the run. Arrivals are constant (a Poisson run of a few
  seconds misses 95% of its target by chance).

Writes `control_plane_<N>.json` and `.md` in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.perf.errors import PerfError
from bench.perf.frontend_overhead import MODEL_NAME, cpu_by_process, cpu_by_role, processes
from bench.perf.rate_run import rate_run
from bench.perf.servers import Servers, free_port, pdserve, url_of
from serve.frontend.settings import FrontendSettings

POLL_INTERVAL_S = FrontendSettings.poll_interval_s  # the frontend's load poll (no flag: its default)


def in_rotation(url: str) -> dict[str, int]:
    r = httpx.get(f"{url}/internal/workers", timeout=30)
    r.raise_for_status()
    out = {"prefill": 0, "decode": 0, "agg": 0}
    for w in r.json()["workers"]:
        if w["in_rotation"] and w.get("role") in out:
            out[w["role"]] += 1
    return out


class RotationWatch:
    """Samples the workers in rotation in a thread; `low` is the fewest seen."""

    def __init__(self, url: str, every_s: float) -> None:
        self.url, self.every_s = url, every_s
        self.samples: list[int] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.samples.append(sum(in_rotation(self.url).values()))
            except httpx.HTTPError:
                self.errors += 1

    def __enter__(self) -> "RotationWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def low(self) -> int | None:
        return min(self.samples) if self.samples else None


def start(args: argparse.Namespace, model: str, servers: Servers) -> tuple[str, dict[int, str]]:
    port = free_port()
    url = url_of(port)
    fe = servers.start("frontend", pdserve("frontend", "--port", str(port), "--model", model, "--served-model-name",
                                           MODEL_NAME, "--log-level", "warning"))
    n_prefill = round(args.workers * args.prefill_share)
    for role, n in (("prefill", n_prefill), ("decode", args.workers - n_prefill)):
        for i in range(math.ceil(n / args.per_process)):
            k = min(args.per_process, n - i * args.per_process)
            servers.start(f"sim {role} x{k}", pdserve(
                "worker", "--engine", "sim", "--role", role, "--replicas", str(k), "--port", "0", "--model", model,
                "--served-model-name", MODEL_NAME, "--frontend", url, "--log-level", "warning",
                "--lease-seconds", str(args.lease_seconds), "--sim-step-model", f"constant:{args.step_ms / 1000:g}",
                "--max-num-seqs", "64"))
    return url, {fe.popen.pid: "frontend"}


def wait_all(url: str, n: int, timeout: float, servers: Servers) -> float:
    t0 = time.monotonic()
    last: dict[str, int] = {}
    while time.monotonic() - t0 < timeout:
        for c in servers.children:
            if c.popen.poll() is not None:
                raise PerfError(f"{c.name} exited ({c.popen.returncode}); log {servers.log.name}")
        try:
            last = in_rotation(url)
            if sum(last.values()) >= n:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise PerfError(f"only {last} of {n} workers in rotation after {timeout:.0f}s; log {servers.log.name}")


def load_run(args: argparse.Namespace, url: str, roots: dict[int, str], tokenizer: str, out: Path,
             rate: float) -> dict[str, Any]:
    with RotationWatch(url, args.sample_s) as watch:
        row = rate_run(url, roots, tokenizer, out, rate, args.seconds, args.isl, args.osl, args.seconds * 10 + 300)
    return {**row, "fewest_in_rotation": watch.low, "rotation_samples": len(watch.samples)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.loadgen.tokenizer import resolve_tokenizer_source
    from serve.model import resolve_model

    model = resolve_model(args.model)
    tokenizer = resolve_tokenizer_source(MODEL_NAME, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = args.workers
    rep: dict[str, Any] = {"simulated": True, "workers": n, "prefill_share": args.prefill_share,
                           "per_process": args.per_process, "poll_interval_s": POLL_INTERVAL_S,
                           "lease_seconds": args.lease_seconds, "step_ms": args.step_ms, "isl": args.isl,
                           "osl": args.osl, "machine_cpus": os.cpu_count()}
    with open(out / f"servers_{n}.log", "wb") as log, Servers(log, grace_s=60) as servers:
        url, roots = start(args, model, servers)
        rep["startup_s"] = round(wait_all(url, n, args.start_timeout, servers), 1)
        print(f"{n} workers in rotation after {rep['startup_s']} s", flush=True)
        procs = processes(roots)
        before, t0 = cpu_by_process(procs), time.monotonic()
        with RotationWatch(url, args.sample_s) as watch:
            time.sleep(args.idle_s)
        idle_cpu = cpu_by_role(procs, before, cpu_by_process(procs)).get("frontend", 0.0)
        rep["idle"] = {"seconds": round(time.monotonic() - t0, 1), "fewest_in_rotation": watch.low,
                       "samples": len(watch.samples), "sample_errors": watch.errors,
                       "frontend_cpu_per_s": round(idle_cpu / (time.monotonic() - t0), 4)}
        print(f"idle: {json.dumps(rep['idle'])}", flush=True)
        rows, best = [], 0.0
        for r in args.rates:
            row = load_run(args, url, roots, tokenizer, out / f"load_{n}_{r:g}", r)
            rows.append(row)
            print(f"rate {r:g}/s: {json.dumps(row)}", flush=True)
            if not row.get("sustained"):
                break
            best = r
        rep["load"] = {"runs": rows, "highest_sustained": best}
    (out / f"control_plane_{n}.json").write_text(json.dumps(rep, indent=2) + "\n")
    text = table(rep)
    (out / f"control_plane_{n}.md").write_text(text)
    print("\n" + text)
    return rep


def table(rep: dict[str, Any]) -> str:
    idle = rep["idle"]
    lines = [f"SIMULATED: one frontend, {rep['workers']} simulated workers ({rep['prefill_share']:.0%} prefill), "
             f"poll {rep['poll_interval_s']} s, lease {rep['lease_seconds']} s; "
             f"in rotation after {rep['startup_s']} s; "
             f"idle {idle['seconds']} s: fewest in rotation {idle['fewest_in_rotation']}, frontend CPU "
             f"{idle['frontend_cpu_per_s']:.3f} s/s", "",
             "| rate /s | achieved /s | errors | frontend CPU ms/request | route p50 / p99 ms | TTFT p50 ms | "
             "fewest in rotation |", "|---|---|---|---|---|---|---|"]
    for r in rep["load"]["runs"]:
        if "failed" in r:
            lines.append(f"| {r['target']:g} | failed: {r['failed'][:60]} | | | | | {r['fewest_in_rotation']} |")
            continue
        lines.append(f"| {r['target']:g} | {r['achieved']:.1f} | {r['errors']:.0f} | "
                     f"{r['frontend_cpu_ms_per_request'] or float('nan'):.2f} | {r['route_ms_p50'] or float('nan'):.3f}"
                     f" / {r['route_ms_p99'] or float('nan'):.3f} | {r['ttft_p50_ms'] or float('nan'):.1f} | "
                     f"{r['fewest_in_rotation']} |")
    lines += ["", f"highest sustained rate: {rep['load']['highest_sustained']:g}/s"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perf.control_plane", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=256, help="simulated workers in all (default: 256)")
    ap.add_argument("--prefill-share", type=float, default=0.5, help="share of prefill workers (default: 0.5)")
    ap.add_argument("--per-process", type=int, default=64, help="simulated workers per process (default: 64)")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 20, 40, 60, 80, 120, 160],
                    help="rising request rates (default: 10 20 40 60 80 120 160)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each load run (default: 20)")
    ap.add_argument("--idle-s", type=float, default=60.0, help="idle phase (default: 60 s)")
    ap.add_argument("--sample-s", type=float, default=1.0, help="rotation sampling period (default: 1 s)")
    ap.add_argument("--lease-seconds", type=float, default=10.0, help="workers' lease (default: 10 s)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="simulated engine step (default: 20 ms)")
    ap.add_argument("--isl", type=int, default=256, help="prompt tokens (default: 256)")
    ap.add_argument("--osl", type=int, default=32, help="output tokens (default: 32)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--out", default="artifacts/control_plane")
    args = ap.parse_args(argv)
    if args.workers < 2 or not 0 < args.prefill_share < 1 or args.per_process < 1:
        print("bench.perf.control_plane: error: --workers >= 2, 0 < --prefill-share < 1, --per-process >= 1",
              file=sys.stderr)
        return 2
    try:
        run(args)
    except PerfError as e:
        print(f"bench.perf.control_plane: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
