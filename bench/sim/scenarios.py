"""SLA-autoscaler scenarios on the offline simulator, each with its parameters here:

    python -m bench.sim.scenarios [step|diurnal|burst|isl-shift|pool-loss ...] [--out DIR] [--seeds N]
        [--cooldown S] [--no-baseline]

Every scenario runs a disaggregated cluster of Llama 3.1 70B, TP 4, on H100 (the planner's
step model, fp8 KV, RDMA-class link), workers starting 60 s after they are asked for, under
32 sequences per worker, TTFT p90 <= 2 s and ITL p90 <= 60 ms, with requests from a
generated Mooncake trace (Poisson arrivals at the scenario's rate; ISL 4,000 and OSL 300
unless said, ± 20%):
- step: 4 req/s for 10 min, 16 req/s (4x) for 10 min, 4 req/s for 10 min;
- diurnal: a day compressed to an hour, rate 4.8-24 req/s (trough at 20% of the peak);
- burst: 4 req/s for 20 min with 40 req/s (10x) for 60 s at minute 10;
- isl-shift: 6 req/s for 30 min, chats (ISL 500) turning into documents (ISL 6,000) at
  minute 10: capacity must move from decode to prefill;
- pool-loss: 8 req/s for 30 min; a third of the decode pool is killed at minute 10.
For each: the autoscaled run (`serve.autoscale`'s controller, bench/sim/scaling.py) and the
static baseline: the fewest fixed (P, D) that meets both targets in every 1-minute window,
found by simulation (starting from the controller's model at the peak: more workers while a
window misses, then one fewer while none does). Reported: SLO attainment (windows meeting
both targets, by arrival minute; a window with a failed request misses, unless the request
was lost with a worker the scenario killed: every layout loses those), windows missed per
event, worker-hours against the baseline's, failed requests, and decisions reversed within
10 minutes. With `--seeds N` each scenario runs on N traces (Poisson realisations of its
rate): the baseline must meet every window of each (a layout met on one trace by luck is not
it), the autoscaled run's attainment counts the windows of all, its worker-hours are their
mean and its misses per event the worst trace's. All SIMULATED.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.sim.slo import ITL_S, PERCENTILE, TTFT_S, WINDOW_S, lost_with_worker, misses_per_event, reversals, windows

SYSTEM, MODEL, TP = "h100_sxm", "meta-llama/Llama-3.1-70B-Instruct", 4
STARTUP_S, INTERVAL_S, COOLDOWN_S = 60.0, 30.0, 60.0
MAX_NUM_SEQS = 32  # decode slots per worker: with 300-token answers, ~5 req/s each
# Prefills one prefill worker gets at once (the frontend's `--max-prefills-per-worker`): enough
# that a worker never idles between two, few enough that a burst's backlog waits in the frontend
# for the workers started for it instead of queuing on those there before it.
PREFILLS_PER_WORKER = 4
# Trace seeds, in order (`--seeds N` takes the first N): 7 is the one every earlier result used.
SEEDS = (7, 1, 2, 3, 4, 5, 6, 8, 9, 10)


@dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: float
    rate: Callable[[float], float]  # requests/s at t
    isl: Callable[[float], int]
    osl: Callable[[float], int]
    events_s: tuple[float, ...] = ()  # when the load changes (for misses per event)
    kill_decode_share_at: tuple[float, float] | None = None  # (t, share of the decode pool)
    describe: str = ""


def _steps(*parts: tuple[float, float]) -> Callable[[float], float]:
    """Piecewise-constant: (until_s, value) pairs."""
    def f(t: float) -> float:
        for until, v in parts:
            if t < until:
                return v
        return parts[-1][1]
    return f


ISL, OSL = 4000, 300
SCENARIOS = {
    "step": Scenario("step", 1800, _steps((600, 4.0), (1200, 16.0), (1800, 4.0)), lambda t: ISL, lambda t: OSL,
                     (600.0, 1200.0), describe="4 req/s, 4x for 10 min, back"),
    "diurnal": Scenario("diurnal", 3600, lambda t: 24.0 * (0.6 - 0.4 * math.cos(2 * math.pi * t / 3600)),
                        lambda t: ISL, lambda t: OSL, describe="4.8-24 req/s over an hour"),
    "burst": Scenario("burst", 1200, _steps((600, 4.0), (660, 40.0), (1200, 4.0)), lambda t: ISL, lambda t: OSL,
                      (600.0, 660.0), describe="4 req/s, 10x for 60 s"),
    "isl-shift": Scenario("isl-shift", 1800, lambda t: 6.0, lambda t: 500 if t < 600 else 6000, lambda t: OSL,
                          (600.0,), describe="ISL 500 -> 6,000 at minute 10"),
    "pool-loss": Scenario("pool-loss", 1800, lambda t: 8.0, lambda t: ISL, lambda t: OSL, (600.0,),
                          kill_decode_share_at=(600.0, 1 / 3), describe="a third of the decode pool lost"),
}


def trace(s: Scenario, path: Path, seed: int = 7) -> int:
    """A Mooncake trace of the scenario: Poisson arrivals (thinning at the peak rate)."""
    rng = random.Random(f"{seed}:{s.name}")
    peak = max(s.rate(t) for t in range(0, int(s.duration_s) + 1))
    t, n = 0.0, 0
    with path.open("w") as f:
        while True:
            t += rng.expovariate(peak)
            if t >= s.duration_s:
                break
            if rng.random() * peak > s.rate(t):
                continue
            isl = max(16, round(s.isl(t) * rng.uniform(0.8, 1.2)))
            osl = max(2, round(s.osl(t) * rng.uniform(0.8, 1.2)))
            f.write(json.dumps({"timestamp": round(t * 1000, 3), "input_length": isl, "output_length": osl}) + "\n")
            n += 1
    return n


def _argv(s: Scenario, tr: Path, out: Path, p: int, d: int) -> list[str]:
    return ["--mode", "disagg", "--prefill", str(p), "--decode", str(d), "--sim-system", SYSTEM, "--sim-model", MODEL,
            "--tp", str(TP), "--network", "rdma", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "16384",
            "--input-file", str(tr), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--max-concurrent-requests", "100000", "--max-queued-requests", "100000", "--ui-type", "none",
            "--max-prefills-per-worker", str(PREFILLS_PER_WORKER),
            "--streaming", "--artifact-dir", str(out)]


def controller(spec: Any, cooldown_s: float = COOLDOWN_S) -> Any:
    from serve.autoscale.decide import Bounds, Controller, Policy, Targets
    from serve.autoscale.model import Engine

    cfg = spec.engine
    kv_tokens = cfg.num_blocks * cfg.block_size
    eng = Engine(spec.step_model, cfg.max_num_seqs, cfg.max_num_batched_tokens, kv_tokens)
    policy = Policy("disagg", Targets(TTFT_S, ITL_S, PERCENTILE), Bounds(max_prefill=128, max_decode=128,
                                                                          max_workers=256),
                    interval_s=INTERVAL_S, startup_s=STARTUP_S, cooldown_s=cooldown_s)
    return Controller(policy, {"prefill": eng, "decode": eng})


def run_one(s: Scenario, tr: Path, out: Path, p: int, d: int, autoscale: bool,
            cooldown_s: float = COOLDOWN_S) -> dict[str, Any]:
    """One simulation of the scenario: fixed (p, d), or autoscaled from (p, d)."""
    from bench.loadgen.config import config_from_args
    from bench.sim.cli import add_command
    from bench.sim.options import spec_from_args
    from bench.sim.run import simulate
    from bench.sim.scaling import SimScaler

    sub = argparse.ArgumentParser(prog="pdserve").add_subparsers()
    add_command(sub)
    args = sub.choices["sim"].parse_args(_argv(s, tr, out, p, d))
    cfg = config_from_args(args, "pdserve sim (scenario)")
    spec = spec_from_args(args)
    scaler = SimScaler(controller(spec, cooldown_s), spec.step_model, STARTUP_S) if autoscale else None
    killed: list[str] = []

    def hook(loop, cluster, flows, total) -> None:  # type: ignore[no-untyped-def]
        if scaler is not None:
            scaler.attach(loop, cluster, flows, total)
        if s.kill_decode_share_at:
            at, share = s.kill_decode_share_at

            def kill() -> None:
                alive = [w for w in cluster.workers.values() if w.role == "decode" and w.alive and not w.draining]
                for w in alive[:max(1, round(len(alive) * share))]:
                    cluster.kill(w.url)
                    killed.append(w.url)
            loop.at(at, kill)
    spec.hook = hook
    t0 = time.monotonic()
    result, _ = simulate(cfg, spec, progress=False)
    end = max((r.end_ns for r in result.records), default=0) / 1e9
    doc = {"layout": f"{p}P+{d}D", "autoscaled": autoscale, "wall_s": round(time.monotonic() - t0, 1),
           "requests": len(result.records), "failed": sum(1 for r in result.records if not r.ok),
           "killed": len(killed), "lost_with_killed": sum(1 for r in result.records if lost_with_worker(r, killed)),
           "windows": windows(result.records, killed)}
    doc["worker_hours"] = (scaler.summary(end)["worker_hours"] if scaler else round((p + d) * end / 3600, 3))
    if scaler:
        doc["autoscaler"] = {**scaler.summary(end), "reversals_within_10min": reversals(scaler),
                             "decisions": [x.to_dict() for x in scaler.decisions if x.changed]}
    return doc


def baseline(s: Scenario, traces: list[Path], out: Path, start: tuple[int, int], limit: int = 8) -> dict[str, Any]:
    """The fewest fixed workers meeting every window of every trace: from `start`, grow the pool
    whose metric missed until every window is met; then take one worker off either pool while
    every window stays met (prefill first), until neither can go. A layout's traces run in
    order and stop at the first that misses (its `missed_per_trace` is then shorter): the
    layout is out either way, and a met one has run them all."""
    p, d = start
    tried: dict[tuple[int, int], list[dict[str, Any]]] = {}

    def bad_windows(p: int, d: int) -> list[dict[str, Any]]:
        rs = tried.setdefault((p, d), [])
        for r in rs:
            if bad := [w for w in r["windows"] if not w["met"]]:
                return bad
        for i, tr in enumerate(traces[len(rs):], start=len(rs)):
            rs.append(run_one(s, tr, out / (f"static-{p}P{d}D" + (f"-{tr.stem}" if i else "")), p, d, False))
            if bad := [w for w in rs[-1]["windows"] if not w["met"]]:
                return bad
        return []

    def meets(p: int, d: int) -> bool:
        return min(p, d) >= 1 and not bad_windows(p, d)
    for _ in range(limit):
        bad = bad_windows(p, d)
        if not bad:
            break
        ttft_bad = any(w["ttft_p90_s"] > TTFT_S for w in bad)
        itl_bad = any(w["itl_p90_s"] > ITL_S for w in bad) or any(w["failed"] > w["lost"] for w in bad)
        p, d = p + (1 if ttft_bad or not itl_bad else 0), d + (1 if itl_bad else 0)
    if meets(p, d):
        while True:
            fewer = next((q for q in ((p - 1, d), (p, d - 1)) if meets(*q)), None)
            if fewer is None:
                break
            p, d = fewer
    rs = tried[(p, d)]
    return {"layout": f"{p}P+{d}D", "workers": p + d, "meets_every_window": not bad_windows(p, d),
            "worker_hours": round(sum(r["worker_hours"] for r in rs) / len(rs), 3),
            "tried": sorted(f"{a}P+{b}D" for a, b in tried),
            # what each layout tried missed, per trace: a layout met on one trace by luck shows here
            "missed_per_trace": {f"{a}P+{b}D": [sum(not w["met"] for w in r["windows"]) for r in tried[(a, b)]]
                                 for a, b in sorted(tried)}}


def run_scenario(name: str, out: Path, seeds: int = 1, cooldown_s: float = COOLDOWN_S,
                 static: bool = True) -> dict[str, Any]:
    """The scenario over `seeds` traces (seed 7, then 1, 2, ...): the autoscaled run on each, and
    (unless not `static`) one static baseline that meets every window of all of them."""
    s = SCENARIOS[name]
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    traces, autos = [], []
    for i, seed in enumerate(SEEDS[:seeds]):
        suffix = f"-seed{seed}" if i else ""  # the first trace keeps the single-trace paths
        tr = d / f"trace{suffix}.jsonl"
        trace(s, tr, seed)
        traces.append(tr)
        # as an operator would start it
        autos.append(run_one(s, tr, d / f"autoscaled{suffix}", *_layout_at(s, 0.0), True, cooldown_s))
    auto = autos[0]
    base = baseline(s, traces, d, _peak_layout(s)) if static else None
    ws = [w for a in autos for w in a["windows"]]
    met = sum(w["met"] for w in ws)
    hours = round(sum(a["worker_hours"] for a in autos) / len(autos), 3)
    # Totals over the traces; the decisions and timeline are the first trace's.
    summary = {**auto["autoscaler"], "reversals_within_10min": sum(a["autoscaler"]["reversals_within_10min"]
                                                                   for a in autos)}
    autoscaled = {**{k: v for k, v in auto.items() if k != "windows"}, "worker_hours": hours,
                  "failed": sum(a["failed"] for a in autos),
                  "lost_with_killed": sum(a["lost_with_killed"] for a in autos), "autoscaler": summary}
    row = {"scenario": name, "describe": s.describe, "requests": sum(a["requests"] for a in autos), "simulated": True,
           "seeds": list(SEEDS[:seeds]), "autoscaled": autoscaled,
           "slo_attainment": round(met / len(ws), 4) if ws else None,
           "windows": len(ws), "missed_windows": len(ws) - met,
           # per event, the worst trace's
           "misses_per_event": [max(x) for x in zip(*(misses_per_event(a["windows"], s.events_s) for a in autos))],
           "cooldown_s": cooldown_s, "static_baseline": base,
           "worker_hours_vs_static": round(hours / base["worker_hours"], 4) if base and base["worker_hours"] else None,
           "allowed_misses_per_event": math.ceil(STARTUP_S / WINDOW_S) + 2,
           "per_seed": [{"seed": seed, "requests": a["requests"], "worker_hours": a["worker_hours"],
                         "missed_windows": sum(not w["met"] for w in a["windows"]), "failed": a["failed"],
                         "reversals_within_10min": a["autoscaler"]["reversals_within_10min"]}
                        for seed, a in zip(SEEDS, autos)]}
    (d / "scenario.json").write_text(json.dumps({**row, "autoscaled_windows": auto["windows"]}, indent=1) + "\n")
    return row


def _peak_layout(s: Scenario) -> tuple[int, int]:
    """The controller model's (P, D) for the scenario's peak rate and longest prompts: where the
    baseline search starts."""
    ts = range(0, int(s.duration_s), 10)
    return _layout_for(max(s.rate(t) for t in ts), max(s.isl(t) for t in ts), max(s.osl(t) for t in ts))


def _layout_at(s: Scenario, t: float) -> tuple[int, int]:
    return _layout_for(s.rate(t), s.isl(t), s.osl(t))


def _layout_for(rate: float, isl: int, osl: int) -> tuple[int, int]:
    from serve.autoscale.model import Load

    load = Load(rate, [isl], [osl])
    from bench.sim.cli import add_command
    from bench.sim.options import spec_from_args

    sub = argparse.ArgumentParser(prog="pdserve").add_subparsers()
    add_command(sub)
    spec = spec_from_args(sub.choices["sim"].parse_args(_argv(SCENARIOS["step"], Path("/dev/null"),
                                                              Path(tempfile.gettempdir()) / "pdserve-peak", 1, 1)))
    c = controller(spec)
    return c.smallest("prefill", load), c.smallest("decode", load)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario (SIMULATED) | requests | SLO attainment | missed windows (per event) | worker-hours auto "
             "/ static (ratio) | static baseline | failed | reversals < 10 min |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["autoscaled"], r["static_baseline"]
        notes = [f"{len(r['seeds'])} traces"] if len(r.get("seeds", ())) > 1 else []
        if r.get("cooldown_s", COOLDOWN_S) != COOLDOWN_S:
            notes.append(f"cool-down {r['cooldown_s']:g} s")
        label = f"{r['scenario']}: {r['describe']}" + (f" ({', '.join(notes)})" if notes else "")
        hours = (f"{a['worker_hours']:.2f} / {b['worker_hours']:.2f} ({r['worker_hours_vs_static']:.2f}) | "
                 f"{b['layout']}{'' if b['meets_every_window'] else ' (not met)'}" if b
                 else f"{a['worker_hours']:.2f} / - | not searched")
        lost = a.get("lost_with_killed")
        lines.append(f"| {label} | {r['requests']} | {r['slo_attainment']:.1%} | {r['missed_windows']} "
                     f"({', '.join(map(str, r['misses_per_event'])) or '-'}) | {hours} | {a['failed']}"
                     f"{f' ({lost} lost with killed workers)' if lost else ''} | "
                     f"{a['autoscaler']['reversals_within_10min']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.scenarios", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=list(SCENARIOS), help=f"scenarios (default: all: {', '.join(SCENARIOS)})")
    p.add_argument("--out", default="artifacts/autoscale_scenarios")
    p.add_argument("--seeds", type=int, default=1,
                   help=f"traces per scenario (Poisson realisations of its rate, seeds {', '.join(map(str, SEEDS))} in "
                        "order): the static baseline must meet every window of each, the autoscaled run is reported "
                        "over all of them (default: 1)")
    p.add_argument("--cooldown", type=float, default=COOLDOWN_S, metavar="S",
                   help=f"the autoscaler's --cooldown (default: {COOLDOWN_S:g}): no decision may reverse within 10 "
                        "minutes whatever it is")
    p.add_argument("--no-baseline", action="store_true",
                   help="the autoscaled runs only, no static baseline search (e.g. a --cooldown sweep)")
    args = p.parse_args(argv)
    if args.cooldown < 0:
        print(f"bench.sim.scenarios: error: --cooldown must be >= 0, not {args.cooldown:g}", file=sys.stderr)
        return 2
    if not 1 <= args.seeds <= len(SEEDS):
        print(f"bench.sim.scenarios: error: --seeds must be 1 to {len(SEEDS)}, not {args.seeds}", file=sys.stderr)
        return 2
    bad = [n for n in args.names if n not in SCENARIOS]
    if bad:
        print(f"bench.sim.scenarios: error: unknown scenario {bad[0]!r} (known: {', '.join(SCENARIOS)})", file=sys.stderr)
        return 2
    out = Path(args.out)
    rows = []
    for name in args.names:
        rows.append(run_scenario(name, out, args.seeds, args.cooldown, not args.no_baseline))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    (out / "scenarios.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
