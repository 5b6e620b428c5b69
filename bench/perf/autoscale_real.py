"""The SLA autoscaler on real engines, small: `python -m bench.perf.autoscale_real [--out DIR]`.

1. **Calibration**: `pdserve up --mode agg` (1 real vLLM worker, the embedded model), `bench
   profile` at concurrency 1 and 8 (ISL 256, OSL 64), `bench calibrate --steps` on the
   worker's engine steps: the `pdserve.profile/1` the autoscaler predicts with.
2. **Rates from the model**: with that profile and the targets (TTFT p90 <= TTFT_MS, ITL p90
   <= ITL_MS), the autoscaler's own model gives the rate from which one worker no longer meets
   them; the heavy phase runs at HEAVY x that rate, the light one at LIGHT x it.
3. **The run**: `pdserve up --mode agg --workers 1 --autoscale --max-agg 2 --interval 15
   --autoscale-profile profile.json`, fed a Mooncake trace on its schedule by `bench profile`:
   the heavy phase (HEAVY_S), then the light phase until the autoscaler has scaled back to
   one worker (the scale-down waits 10 minutes after the scale-up, then holds 2 minutes) plus
   a minute, LIGHT_MAX_S at most. Requests keep arriving through the scale-down, so its drain
   has streams to finish.
Reported (`<out>/autoscale_real.json` and a line on stdout): the worker count over time,
when it went 1 -> 2 -> 1, the decisions that did it, failed requests (the target: 0), and
per-phase TTFT/ITL p90 measured by the client.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.perf.servers import Servers, free_port, pdserve, url_of
from serve.auth import token_headers

MODEL = "smollm2-135m-instruct"
ISL, OSL = 256, 64
TTFT_MS, ITL_MS = 1000.0, 60.0
HEAVY, LIGHT = 1.3, 0.3  # x the rate from which one worker misses a target (by the model)
HEAVY_S, LIGHT_MAX_S = 180.0, 1080.0


def threshold_rate(profile: Path, max_num_seqs: int) -> float:
    """The smallest request rate (0.05 steps) at which the model wants 2 aggregated workers."""
    from serve.autoscale.cli import load_profile
    from serve.autoscale.decide import Bounds, Controller, Policy, Targets
    from serve.autoscale.model import Engine, Load

    step, kv = load_profile(str(profile))
    c = Controller(Policy("agg", Targets(TTFT_MS / 1000, ITL_MS / 1000), Bounds(max_agg=4)),
                   {"agg": Engine(step, max_num_seqs, 8192, kv or 10**9)})
    rate = 0.05
    while rate < 50 and c.smallest("agg", Load(rate, [ISL], [OSL])) < 2:
        rate += 0.05
    return round(rate, 2)


def write_trace(path: Path, phases: list[tuple[float, float]]) -> int:
    """Constant-rate arrivals, phase after phase: (rate, seconds)."""
    t, n = 0.0, 0
    with path.open("w") as f:
        for rate, seconds in phases:
            end = t + seconds
            while t < end:
                f.write(json.dumps({"timestamp": round(t * 1000, 3), "input_length": ISL, "output_length": OSL}) + "\n")
                n += 1
                t += 1.0 / rate
    return n


def _load(url: str, out: Path, argv: list[str], log: Any) -> subprocess.Popen:
    """`pdserve bench profile` against `url` as a process (SIGINT: it stops and writes what it has)."""
    return subprocess.Popen(pdserve("bench", "profile", "-m", MODEL, "-u", url, "--ui-type", "none", "--artifact-dir",
                                    str(out), "--streaming", "--extra-inputs", "ignore_eos:true", *argv),
                            stdout=log, stderr=subprocess.STDOUT)


def run(out: Path) -> dict[str, Any]:
    from bench.sim.stepfit import calibrate_steps
    from serve.model import resolve_model

    model = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "servers.log", "wb")
    token = os.environ.get("PDSERVE_CLUSTER_TOKEN") or secrets.token_hex(16)
    env, headers = {**os.environ, "PDSERVE_CLUSTER_TOKEN": token}, token_headers(token)
    profile = out / "profile.json"
    common = ["--model", model, "--served-model-name", MODEL, "--ready-timeout", "900", "--kv-cache-gib", "1"]
    # 1. Calibration on one real worker.
    with Servers(log) as servers:
        port, wport = free_port(), free_port()
        servers.serve("up", pdserve("up", "--port", str(port), "--worker-base-port", str(wport), *common),
                      f"{url_of(port)}/health", env=env, timeout=1200)
        for c in (1, 8):
            _load(url_of(port), out / f"calibrate-c{c}", ["--isl", str(ISL), "--osl", str(OSL), "--concurrency",
                                                           str(c), "--num-requests", str(6 * c)], log).wait(900)
        with contextlib.redirect_stdout(io.StringIO()):
            calibrate_steps([url_of(wport)], str(profile), token, system="this-machine")
    # 2. Rates from the autoscaler's model.
    r1 = threshold_rate(profile, 256)
    heavy, light = round(HEAVY * r1, 3), round(LIGHT * r1, 3)
    n = write_trace(out / "trace.jsonl", [(heavy, HEAVY_S), (light, LIGHT_MAX_S)])
    print(f"one worker misses from {r1} req/s (model); heavy {heavy} req/s for {HEAVY_S:.0f} s, then light "
          f"{light} req/s; {n} requests at most", flush=True)
    # 3. The autoscaled run.
    port, wport, aport = free_port(), free_port(), free_port()
    fe, api = url_of(port), url_of(aport)
    series: list[dict[str, Any]] = []
    went_up = went_down = None
    with Servers(log) as servers:
        servers.serve("up --autoscale", pdserve(
            "up", "--port", str(port), "--worker-base-port", str(wport), "--autoscale", "--ttft", str(TTFT_MS),
            "--itl", str(ITL_MS), "--interval", "15", "--max-agg", "2", "--autoscale-profile", str(profile),
            "--autoscale-port", str(aport), *common), f"{fe}/health", env=env, timeout=1200)
        t0 = time.monotonic()
        load = _load(fe, out / "load", ["--input-file", str(out / "trace.jsonl"), "--custom-dataset-type",
                                        "mooncake_trace", "--fixed-schedule", "--request-timeout-seconds", "300"], log)
        while load.poll() is None:
            time.sleep(5)
            try:
                rows = httpx.get(f"{fe}/internal/workers", headers=headers, timeout=5).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            t = round(time.monotonic() - t0, 1)
            ready = sum(1 for r in rows if r["in_rotation"])
            series.append({"t": t, "in_rotation": ready, "leaving": len(rows) - ready})
            if ready >= 2 and went_up is None:
                went_up = t
            if went_up is not None and went_down is None and ready == 1 and len(rows) == 1:
                went_down = t
                stop_at = time.monotonic() + 60  # a minute more at one worker, then stop the load
            if went_down is not None and time.monotonic() > stop_at:
                break
        explain = httpx.get(f"{api}/autoscaler", timeout=10).json()
        if load.poll() is None:  # stop the light phase: on SIGINT bench profile writes what it has
            load.send_signal(signal.SIGINT)
            try:
                load.wait(120)
            except subprocess.TimeoutExpired:
                load.kill()
    recs = [json.loads(line) for line in (out / "load" / "profile_export.jsonl").read_text().splitlines() if line]
    # requests cut by the stop of the load itself (SIGINT at the end) are not failures of the stack
    failed = [r for r in recs if r.get("error") and not r["metadata"].get("was_cancelled")]
    doc = {"threshold_rate": r1, "heavy_rate": heavy, "light_rate": light, "targets_ms": [TTFT_MS, ITL_MS],
           "requests": len(recs), "failed": len(failed), "errors": [r["error"] for r in failed][:5],
           "scaled_up_at_s": went_up, "scaled_down_at_s": went_down, "most_in_rotation": max(
               (s["in_rotation"] for s in series), default=0),
           "decisions": [d for d in explain["decisions"] if d["changed"]], "actions": explain["actions"],
           "series": series}
    (out / "autoscale_real.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.autoscale_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("artifacts/autoscale-real"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    doc = run(args.out)
    ok = doc["failed"] == 0 and doc["scaled_up_at_s"] is not None and doc["scaled_down_at_s"] is not None
    print(f"real engines: 1 -> 2 at {doc['scaled_up_at_s']} s, -> 1 at {doc['scaled_down_at_s']} s; "
          f"{doc['requests']} requests, {doc['failed']} failed: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
