"""Engine memory: `pdserve bench engine-memory` measures how a CPU engine's heap grows under
prefills of ever-changing length, once per oneDNN primitive-cache capacity, in one run.

For each capacity in `--capacities` (default: 1024, oneDNN's own default, then 128,
pdserve's), it starts one aggregated worker pinned to core 0 with
`ONEDNN_PRIMITIVE_CACHE_CAPACITY` set, sends the same load (`--clients` closed-loop clients,
prompts of uniformly random 20-1500 token ids, one output token, half seeded) for
`--duration` seconds, and reads the engine process's heap in use (glibc mallinfo2) and RSS
from the lines the heap trimmer (serve.allocator) logs every `--trim-interval` seconds.

Reported per capacity (`<out>/engine_memory.json`, and a table): requests served, heap in
use after warm-up (the first trim) and at the end, its growth and least-squares trend, and
RSS. The check is the ratio of heap growth between the capacities, measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, url_of
from bench.perf.soak import trend_mib_per_h

MODEL = "smollm2-135m-instruct"
LINE = re.compile(r"\((?:Worker|VllmWorker)[^)]*pid=(\d+)\).*?rss (\d+) MiB, heap in use (\d+) MiB; (\d+) calls")


def add_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("engine-memory", help="a CPU engine's heap growth per oneDNN primitive-cache capacity",
                        description=__doc__.split("\n\n")[0] if __doc__ else None)
    s.add_argument("--capacities", default="1024,128",
                   help="comma-separated ONEDNN_PRIMITIVE_CACHE_CAPACITY values, run in turn (default: 1024,128)")
    s.add_argument("--duration", type=float, default=180.0, help="seconds of load per capacity (default: 180)")
    s.add_argument("--clients", type=int, default=3, help="closed-loop clients (default: 3)")
    s.add_argument("--trim-interval", type=float, default=15.0,
                   help="PDSERVE_MALLOC_TRIM_S for the engine: how often heap use is sampled (default: 15)")
    s.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    s.add_argument("--seed", type=int, default=0, help="random seed of the load (default: 0)")
    s.add_argument("--out", default="artifacts/engine-memory", help="output folder (default: artifacts/engine-memory)")


def _capacities(text: str) -> list[int]:
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PerfError(f"--capacities must be integers, got {text!r}") from None
    if not caps or any(c < 0 for c in caps):
        raise PerfError(f"--capacities must be integers >= 0, got {text!r}")
    return caps


def _drive(url: str, args: argparse.Namespace) -> int:
    stop_at = time.monotonic() + args.duration
    served = [0] * args.clients

    def client(k: int) -> None:
        rng = random.Random(args.seed * 1000 + k)
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as c:
            while time.monotonic() < stop_at:
                n = rng.randrange(20, 1500)
                seed = rng.randrange(2**31) if rng.random() < 0.5 else None
                body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)],
                        "sampling": {"max_tokens": 1, "temperature": 0.7, "seed": seed}}
                with c.stream("POST", f"{url}/generate", json=body) as r:
                    if r.status_code != 200:
                        raise PerfError(f"worker answered {r.status_code}: {r.read()[:200]!r}")
                    for _ in r.iter_lines():
                        pass
                served[k] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.duration + 300)
    return sum(served)


def measure(capacity: int, args: argparse.Namespace, model: str, out: Path) -> dict:
    port = free_port()
    url = url_of(port)
    log_path = out / f"worker-{capacity}.log"
    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(capacity),
           "PDSERVE_MALLOC_TRIM_S": f"{args.trim_interval:g}", "PDSERVE_MALLOC_TRIM_VERBOSE": "1"}
    cmd = pdserve("worker", "--role", "agg", "--host", "127.0.0.1", "--port", str(port), "--model", model,
                  "--served-model-name", MODEL, "--cpu-cores", "0", "--kv-cache-gib", "1", "--max-num-seqs", "8",
                  "--max-model-len", "4096", "--no-kv-events")
    with open(log_path, "wb") as log, Servers(log) as servers:
        servers.serve(f"worker (capacity {capacity})", cmd, f"{url}/health", env=env, timeout=600)
        started = time.monotonic()
        served = _drive(url, args)
        took = time.monotonic() - started
    rows = [tuple(int(x) for x in m.groups()) for m in map(LINE.search, log_path.read_text(errors="replace").splitlines())
            if m]
    if not rows:
        raise PerfError(f"no heap samples in {log_path} (is the pdserve vLLM plugin installed?)")
    engine_pid = max({pid for pid, *_ in rows}, key=lambda p: max(r[1] for r in rows if r[0] == p))
    series = [(calls * args.trim_interval, rss, heap) for pid, rss, heap, calls in rows if pid == engine_pid]
    first, last = series[0], series[-1]
    return {
        "capacity": capacity, "requests": served, "load_seconds": round(took, 1),
        "heap_in_use_first_mib": first[2], "heap_in_use_end_mib": last[2], "heap_growth_mib": last[2] - first[2],
        "heap_trend_mib_per_h": round(trend_mib_per_h([t for t, _, _ in series], [h for _, _, h in series]), 1),
        "rss_first_mib": first[1], "rss_end_mib": last[1],
        "series": [{"t_s": t, "rss_mib": r, "heap_in_use_mib": h} for t, r, h in series],
    }


def run(args: argparse.Namespace) -> int:
    from serve.model import resolve_model

    caps = _capacities(args.capacities)
    if args.duration <= 0 or args.clients < 1 or args.trim_interval <= 0:
        raise PerfError("--duration, --clients and --trim-interval must be positive")
    model = resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [measure(c, args, model, out) for c in caps]
    report = {"duration_s": args.duration, "clients": args.clients, "trim_interval_s": args.trim_interval,
              "results": results}
    base = results[0]["heap_growth_mib"]
    for r in results:
        r["heap_growth_vs_first"] = round(r["heap_growth_mib"] / base, 3) if base > 0 else None
    (out / "engine_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"engine memory: {args.clients} clients, prompts of 20-1500 tokens, {args.duration:.0f} s per capacity")
    print(f"{'capacity':>9} {'requests':>9} {'heap first':>11} {'heap end':>9} {'growth':>8} {'trend':>12} "
          f"{'rss end':>8} {'growth ratio':>13}")
    for r in results:
        ratio = "" if r["heap_growth_vs_first"] is None else f"{r['heap_growth_vs_first']:.2f}"
        print(f"{r['capacity']:>9} {r['requests']:>9} {r['heap_in_use_first_mib']:>7} MiB {r['heap_in_use_end_mib']:>5} MiB "
              f"{r['heap_growth_mib']:>+4} MiB {r['heap_trend_mib_per_h']:>+7.0f} MiB/h {r['rss_end_mib']:>4} MiB "
              f"{ratio:>13}")
    print(f"wrote {out / 'engine_memory.json'}")
    return 0
