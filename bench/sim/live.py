"""SLA-autoscaler scenarios live: simulated workers behind the real frontend, the autoscaler
acting through the local actuator (`pdserve up --engine sim --autoscale`), real processes and
HTTP, wall-clock time:

    python -m bench.sim.live [step|diurnal|burst|isl-shift|pool-loss ...] [--out DIR]

Each scenario is bench/sim/scenarios.py's (same shape, durations and lengths) with the rate
times RATE_SCALE and MAX_NUM_SEQS sequences per worker, so its peak needs 32 or more
workers while the box carries the traffic (frontend, load generator and every worker process
share its cores). Step times: the planner's Llama 3.1 70B TP 4 on H100 (as offline), slowed
SLOWDOWN times with the targets stretched as much (see SLOWDOWN: at speed 1, 50+ simulated
workers stepping every 20-40 ms starved the two cores and the scenario measured the box);
every worker starts STARTUP_S after it is asked for (`--sim-startup-s`, wall-clock). The
load: `pdserve bench profile` replaying the scenario's Mooncake trace on its schedule.
Pool loss: a third of the decode processes are killed (SIGKILL) at its minute.
Reported per scenario: requests, failed requests (the target: 0 across every scale-down),
what the autoscaler did (scale-ups, drains, stops), the most workers at once, per-minute SLO
attainment (as offline), and decisions reversed within 10 minutes. SIMULATED engines.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.sim.scenarios import (INTERVAL_S, ITL_S, MODEL, PERCENTILE, SCENARIOS, STARTUP_S, SYSTEM, TP, TTFT_S,
                                 WINDOW_S, Scenario, trace)
from bench.sim.slo import reversal_count
from serve.auth import token_headers

RATE_SCALE = 0.3
MAX_NUM_SEQS = 4  # decode slots per worker: a small batch, so the box's traffic needs many workers
# Engine time runs SLOWDOWN x slower (`--sim-speedup 1/SLOWDOWN`), the latency targets are
# SLOWDOWN x longer: the same scenario in slow motion on the engine side, so 32+ workers'
# steps and streamed tokens fit the two cores this runs on beside the frontend and the load
# generator. Start-up, intervals, cool-down and the 10-minute hold stay in wall-clock time.
SLOWDOWN = 4.0
SERVED = "smollm2-135m-instruct"
# Prefills one prefill worker gets at once (`--max-prefills-per-worker`): four ~4,000-token
# prompts (two 2,048-token steps each), so a worker never idles between two. Without a cap a burst's backlog
# stayed queued on the two workers there before it (2026-12-06: 151 prompts waited the 240 s
# prefill timeout there and fell back to a local prefill while 16 new prefill workers idled).
PREFILLS_PER_WORKER = 4
# Worker processes run at this niceness (`pdserve up --worker-nice`): in a cluster they have
# their own machines and the frontend its own CPU; here 50 worker processes shared two cores
# with it, and it stood still more than 130 s of a 33-minute step run (pdserve_frontend_event_loop_
# stalled_seconds, 2026-12-07), counting arrivals and reading streams late. Their modelled
# steps are sleeps: a late wake-up shows as a longer ITL, which the run still measures.
WORKER_NICE = 10


def scaled(s: Scenario) -> Scenario:
    return Scenario(s.name, s.duration_s, lambda t: s.rate(t) * RATE_SCALE, s.isl, s.osl, s.events_s,
                    s.kill_decode_share_at, f"{s.describe} (rate x{RATE_SCALE:g})")


def start_layout(profile: Path, s: Scenario) -> tuple[int, int]:
    """The autoscaler model's (P, D) for the scenario's first minute: where an operator starts."""
    from serve.autoscale.cli import load_profile
    from serve.autoscale.decide import Bounds, Controller, Policy, Targets
    from serve.autoscale.model import Engine, Load

    step, kv = load_profile(str(profile))
    eng = Engine(step, MAX_NUM_SEQS, 8192, kv or 10**9, SLOWDOWN)
    c = Controller(Policy("disagg", Targets(TTFT_S * SLOWDOWN, ITL_S * SLOWDOWN, PERCENTILE),
                          Bounds(max_prefill=64, max_decode=64)),
                   {"prefill": eng, "decode": eng})
    load = Load(s.rate(0.0), [s.isl(0.0)], [s.osl(0.0)])
    return c.smallest("prefill", load), c.smallest("decode", load)


class Watch(threading.Thread):
    """Every 10 s: the frontend's workers by role and state (the most at once, worker-minutes)."""

    def __init__(self, frontend: str, headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.frontend, self.headers, self.series, self.stop_event = frontend, headers, [], threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop_event.wait(10.0):
            try:
                rows = httpx.get(f"{self.frontend}/internal/workers", headers=self.headers,
                                 timeout=5).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            n = {"t": round(time.monotonic() - t0, 1)}
            for r in rows:
                key = f"{r['role']}_{'ready' if r['in_rotation'] else 'out'}"
                n[key] = n.get(key, 0) + 1
            self.series.append(n)


# A request that failed within this long after the pool-loss kill, having started before it,
# counts as lost with the killed workers (its stream broke when they died): as offline, those
# miss no window, since every layout loses them. The client's records do not name the worker.
LOST_WITHIN_S = 30.0


def _lost(r: dict[str, Any], killed_at_ns: int | None) -> bool:
    if killed_at_ns is None or not r.get("error"):
        return False
    m = r["metadata"]
    return m["request_start_ns"] < killed_at_ns <= m["request_end_ns"] <= killed_at_ns + LOST_WITHIN_S * 1e9


def windows(export: Path, killed_at_ns: int | None = None) -> tuple[list[dict[str, Any]], int, int]:
    """Per arrival minute from the client's records: p90 TTFT and ITL, failures (those lost
    with killed workers apart, `_lost`), met; and the totals (requests, failed)."""
    from serve.autoscale.model import quantile

    recs = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    if not recs:
        return [], 0, 0
    base = min(r["metadata"]["request_start_ns"] for r in recs)
    by: dict[int, list[dict]] = {}
    for r in recs:
        by.setdefault(int((r["metadata"]["request_start_ns"] - base) / 1e9 // WINDOW_S), []).append(r)
    out = []
    for k in sorted(by):
        rs = by[k]
        ok = [r for r in rs if not r.get("error")]
        lost = sum(1 for r in rs if _lost(r, killed_at_ns))
        ttft = [r["metrics"]["time_to_first_token"]["value"] / 1e3 for r in ok if "time_to_first_token" in r["metrics"]]
        itl = [r["metrics"]["inter_token_latency"]["value"] / 1e3 for r in ok if "inter_token_latency" in r["metrics"]]
        t90, i90 = quantile(ttft, PERCENTILE) if ttft else 0.0, quantile(itl, PERCENTILE) if itl else 0.0
        out.append({"minute": k, "requests": len(rs), "failed": len(rs) - len(ok), "lost": lost,
                    "ttft_p90_s": round(t90, 4), "itl_p90_s": round(i90, 5),
                    "met": len(ok) + lost == len(rs) and t90 <= TTFT_S * SLOWDOWN and i90 <= ITL_S * SLOWDOWN})
    return out, len(recs), sum(1 for r in recs if r.get("error"))


def kill_decode_share(frontend: str, share: float, headers: dict[str, str]) -> list[str]:
    """SIGKILL the processes of a share of the decode workers in rotation (by their ports)."""
    rows = [r for r in httpx.get(f"{frontend}/internal/workers", headers=headers, timeout=5).json()["workers"]
            if r["role"] == "decode" and r["in_rotation"]]
    victims = rows[:max(1, round(len(rows) * share))]
    for r in victims:
        kill_port(int(r["url"].rsplit(":", 1)[1]))
    return [r["url"] for r in victims]


def kill_port(port: int) -> None:
    """SIGKILL the process started with `--port PORT` (a worker of `pdserve up`); an error if
    none was. (The pattern begins with "--": without pkill's own "--" it read it as an option,
    killed nothing and said so only on stderr.)"""
    rc = subprocess.run(["pkill", "-KILL", "-f", "--", f"--port {port}( |$)"], check=False).returncode
    if rc != 0:
        raise RuntimeError(f"no process with --port {port} was killed (pkill exit {rc})")


def frontend_stalled_s(fe: str, headers: dict[str, str]) -> float | None:
    """Seconds the frontend's event loop stood still over the run (its metric), or None."""
    try:
        text = httpx.get(f"{fe}/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("pdserve_frontend_event_loop_stalled_seconds "):
            return round(float(line.split()[1]), 1)
    return None


def run_live(name: str, out: Path, port: int, worker_base_port: int, scaler_port: int,
             duration_s: float | None = None, extend_s: float = 0.0) -> dict[str, Any]:
    from bench.sim.profiles import planner_profile

    s = scaled(SCENARIOS[name])
    if duration_s is not None:  # a shorter run of the same shape (smoke checks)
        s = Scenario(s.name, min(s.duration_s, duration_s), s.rate, s.isl, s.osl, s.events_s,
                     s.kill_decode_share_at, s.describe + f", first {duration_s:g} s")
    if extend_s > 0:  # the load goes on as after the last event: the scale-down that follows it
        s = Scenario(s.name, s.duration_s + extend_s, s.rate, s.isl, s.osl, s.events_s, s.kill_decode_share_at,
                     s.describe + f", {extend_s / 60:g} min longer")
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    profile = d / "profile.json"
    profile.write_text(json.dumps(planner_profile(MODEL, SYSTEM, TP, "fp8", "rdma"), indent=1) + "\n")
    n = trace(s, d / "trace.jsonl")
    p0, d0 = start_layout(profile, s)
    fe, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{scaler_port}"
    up_cmd = [sys.executable, "-m", "serve.cli", "up", "--engine", "sim", "--mode", "disagg", "--prefill", str(p0),
              "--decode", str(d0), "--sim-profile", str(profile), "--sim-startup-s", str(STARTUP_S),
              "--sim-speedup", str(1 / SLOWDOWN),
              "--max-num-seqs", str(MAX_NUM_SEQS), "--autoscale", "--ttft", str(TTFT_S * 1000 * SLOWDOWN), "--itl",
              str(ITL_S * 1000 * SLOWDOWN), "--percentile", str(PERCENTILE), "--interval", str(INTERVAL_S), "--startup-s",
              str(STARTUP_S + 5), "--max-prefill", "64", "--max-decode", "64", "--max-workers", "96",
              "--port", str(port), "--worker-base-port", str(worker_base_port), "--autoscale-port", str(scaler_port),
              # the frontend's wall-clock timeouts stretched with the engine (a prefill queue that lasts
              # 15 s at speed 1 lasts 60 s here)
              "--prefill-timeout", str(60 * SLOWDOWN), "--worker-read-timeout", str(120 * SLOWDOWN),
              "--request-timeout", str(600 * SLOWDOWN),
              # admission as offline (bench/sim/scenarios.py): the engines queue, the frontend does not
              "--max-concurrent-requests", "100000", "--max-queued-requests", "100000",
              "--queue-timeout", str(60 * SLOWDOWN),
              # prefills beyond PREFILLS_PER_WORKER a worker wait in the frontend, so workers started
              # for a burst take part of its backlog (serve/frontend/prefillgate.py)
              "--max-prefills-per-worker", str(PREFILLS_PER_WORKER),
              "--worker-nice", str(WORKER_NICE),
              "--kv-cache-gib", "8",  # bookkeeping only for simulated workers: room to hold 4,000-token prompts
              "--ready-timeout", "600", "--log-level", "warning"]
    token = secrets.token_hex(16)  # the cluster's: /internal/workers needs it
    headers = token_headers(token)
    log = (d / "up.log").open("w")
    up = subprocess.Popen(up_cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                          env={**os.environ, "PDSERVE_CLUSTER_TOKEN": token})
    watch = Watch(fe, headers)
    killed: list[str] = []
    killed_at_ns: int | None = None
    load: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + 900
        while True:
            if up.poll() is not None:
                raise RuntimeError(f"pdserve up exited ({up.returncode}); see {d / 'up.log'}")
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up not ready in 900 s; see {d / 'up.log'}")
            time.sleep(1)
        watch.start()
        load = subprocess.Popen([
            sys.executable, "-m", "serve.cli", "bench", "profile", "-m", SERVED, "--endpoint-type", "chat", "-u", fe,
            "--input-file", str(d / "trace.jsonl"), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--streaming", "--extra-inputs", "ignore_eos:true", "--ui-type", "none", "--artifact-dir", str(d / "load"),
            "--request-timeout-seconds", str(300 * SLOWDOWN)], stdout=(d / "load.log").open("w"), stderr=subprocess.STDOUT)
        if s.kill_decode_share_at:
            at, share = s.kill_decode_share_at
            t0 = time.monotonic()
            while load.poll() is None and time.monotonic() - t0 < at:
                time.sleep(1)
            if load.poll() is None:
                killed_at_ns = time.time_ns()
                killed = kill_decode_share(fe, share, headers)
        load.wait(timeout=s.duration_s + 900)
        explain = httpx.get(f"{api}/autoscaler", timeout=10).json()
        stalled_s = frontend_stalled_s(fe, headers)
    finally:
        watch.stop_event.set()
        if load is not None and load.poll() is None:  # interrupted: the load first, then the stack
            load.send_signal(signal.SIGINT)
            try:
                load.wait(60)
            except subprocess.TimeoutExpired:
                load.kill()
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
        log.close()
    ws, requests, failed = windows(d / "load" / "profile_export.jsonl", killed_at_ns)
    acts = explain["actions"]
    total = [sum(v for k, v in x.items() if k.endswith("_ready")) for x in watch.series]
    met = sum(w["met"] for w in ws)
    row = {"scenario": name, "describe": s.describe, "simulated": True, "trace_requests": n, "requests": requests,
           "failed": failed, "lost_with_killed": sum(w["lost"] for w in ws), "killed_decode_workers": len(killed),
           "start_layout": f"{p0}P+{d0}D",
           "most_workers_in_rotation": max(total, default=0),
           "worker_minutes": round(sum(total) * 10 / 60, 1),
           "started": sum(a["kind"] == "start" for a in acts), "drained": sum(a["kind"] == "drained" for a in acts),
           "stopped": sum(a["kind"] == "stop" for a in acts),
           "actuator_errors": [a for a in acts if a["kind"] == "error"],
           "slo_attainment": round(met / len(ws), 4) if ws else None, "missed_windows": len(ws) - met,
           "frontend_stalled_s": stalled_s, "worker_nice": WORKER_NICE,
           "reversals_within_10min": reversal_count((x["t"], x["current"], x["desired"])
                                                    for x in sorted(explain["decisions"], key=lambda x: x["t"]))}
    (d / "live.json").write_text(json.dumps({**row, "windows": ws, "series": watch.series,
                                             "decisions": [x for x in explain["decisions"] if x["changed"]],
                                             "actions": acts}, indent=1) + "\n")
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario (LIVE, simulated workers) | requests | failed | most workers | started / drained / stopped "
             "| SLO attainment | missed windows | reversals < 10 min |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lost = f" ({r['lost_with_killed']} lost with killed workers)" if r.get("lost_with_killed") else ""
        lines.append(f"| {r['scenario']}: {r['describe']} | {r['requests']} | {r['failed']}{lost} | "
                     f"{r['most_workers_in_rotation']} | {r['started']} / {r['drained']} / {r['stopped']} | "
                     f"{r['slo_attainment']:.1%} | {r['missed_windows']} | {r['reversals_within_10min']} |")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.live", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=list(SCENARIOS), help=f"scenarios (default: all: {', '.join(SCENARIOS)})")
    p.add_argument("--out", type=Path, default=Path("artifacts/autoscaler-live"))
    p.add_argument("--port", type=int, default=8400, help="the frontend's port (default: 8400)")
    p.add_argument("--worker-base-port", type=int, default=18000, help="first worker port; 100 are used (default: 18000)")
    p.add_argument("--autoscale-port", type=int, default=8490)
    p.add_argument("--duration-s", type=float, default=None, help="run only the first S seconds of each scenario")
    p.add_argument("--extend-s", type=float, default=0.0,
                   help="run each scenario S seconds longer, its load going on as after its last event (a burst's "
                        "scale-down comes 10 min after its scale-up; default: 0)")
    args = p.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the stack started here is stopped
    signal.signal(signal.SIGTERM, _interrupt)
    bad = [x for x in args.names if x not in SCENARIOS]
    if bad:
        print(f"python -m bench.sim.live: error: unknown scenario(s) {', '.join(bad)}; choose from "
              f"{', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    rows = []
    for name in args.names:
        rows.append(run_live(name, args.out, args.port, args.worker_base_port, args.autoscale_port, args.duration_s,
                             args.extend_s))
        print(table(rows[-1:]), flush=True)
    (args.out / "live.md").write_text(table(rows) + "\n")
    print(table(rows))
    # failures are allowed only for requests lost with the workers the scenario killed
    return 0 if all(r["failed"] == r["lost_with_killed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
