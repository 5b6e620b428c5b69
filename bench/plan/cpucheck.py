"""The planner on this machine's own hardware: `python -m bench.plan.cpucheck [--out DIR]`.

1. A real aggregated stack (`pdserve up --mode agg`, 1 worker, the embedded model), `bench
   profile` closed-loop at the calibration concurrencies (default 1 and 4; fixed ISL 256 / OSL
   64, streaming, `ignore_eos`), then `bench calibrate --steps` on the worker's engine steps:
   a `pdserve.profile/1` that stands for the system (`pdserve plan --system profile.json`).
2. The same stack at the prediction concurrencies (default 8 and 16), then a 1 prefill + 1
   decode stack at `--disagg-concurrency` (default 4 and 8).
   `--profile DIR/profile.json` skips step 1 and predicts on an earlier run's calibration
   (e.g. `--profile DIR/profile.json --predict --disagg-concurrency 4 8`: the 1P+1D points only).
3. Per point, the predictions on that profile against the measured TTFT p50 and inter-token
   latency p50 (TPOT), and their errors (the target is 15%): the same closed loop through
   the simulator (`pdserve sim` on the profile, what `plan --simulate` runs), the planner's
   closed-loop fixed-length closed forms (perf.py `predict_agg_waves`,
   `predict_disagg_waves`) and its steady-state `predict_agg`. `<out>/cpucheck.json` (with
   the calibration's step records in `steps.json`) and a table on stdout.

The engines run without chunked prefill (pdserve's CPU default), so a step's token budget is
vLLM's for that case, max(max_model_len, 2048), read from the worker. The frontend and the
client share the two cores with the engines: that contention is in the measurement, not in
the profile (calibrated with one engine), and is reported, not modelled.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.perf.servers import Servers, free_port, pdserve, url_of
from bench.sim.validate import MODEL, _real, _sim, _worker_urls, _workload

ISL, OSL = 256, 64
EMBEDDED = "HuggingFaceTB/SmolLM2-135M-Instruct"


def predictions(profile: Path, budget: int, concurrency: int, mode: str) -> dict[str, dict[str, float]]:
    """The planner's figures on the measured profile at one closed-loop concurrency."""
    from bench.plan.perf import Engine, predict_agg, predict_agg_waves, predict_disagg_waves
    from bench.plan.specs import load_model, system_of_profile

    system = replace(system_of_profile(json.loads(profile.read_text()), str(profile)), max_num_batched_tokens=budget)
    e = Engine(load_model(EMBEDDED), system, 1, "bf16")
    if mode == "agg":
        out = {"waves": predict_agg_waves(e, concurrency, 1, ISL, OSL), "steady": predict_agg(e, concurrency, 1, ISL, OSL)}
    else:
        out = {"waves": predict_disagg_waves(e, e, concurrency, ISL, OSL, "rdma")}
    return {k: {"ttft_p50": p.ttft_ms, "itl_p50": p.tpot_ms} for k, p in out.items()}


def run(args: argparse.Namespace) -> int:
    import httpx

    from bench.sim.stepfit import calibrate_steps
    from serve.auth import token_headers
    from serve.model import resolve_model

    if args.profile is not None and not Path(args.profile).is_file():
        raise SystemExit(f"cpucheck: --profile {args.profile}: no such file")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = resolve_model(None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "servers.log", "wb")
    token = os.environ.get("PDSERVE_CLUSTER_TOKEN") or secrets.token_hex(16)
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": token}
    t0 = time.monotonic()
    doc: dict[str, Any] = {"isl": ISL, "osl": OSL, "points": {}}

    def up(servers: Servers, layout: list[str]) -> tuple[str, list[str]]:
        port, wport = free_port(), free_port()
        servers.serve("up", pdserve("up", "--port", str(port), "--worker-base-port", str(wport), "--model", model,
                                    "--served-model-name", MODEL, "--ready-timeout", "900", "--max-num-seqs", "64",
                                    *layout), f"{url_of(port)}/health", env=env, timeout=1200)
        return url_of(port), _worker_urls(url_of(port), token)

    def measure(url: str, workers: list[str], c: int, name: str) -> dict[str, float]:
        return _real(url, model, out / name, [*_workload("fixed", None, max(8, args.rounds * c), c),
                                              "--num-warmup-requests", str(c)], workers, token)

    def engine_info(worker: str) -> dict[str, Any]:
        return httpx.get(f"{worker}/info", headers=token_headers(token), timeout=10).json()

    reused = args.profile is not None
    profile = Path(args.profile) if reused else out / "profile.json"
    calibrate = [] if reused else args.calibrate
    measured: dict[str, dict[str, float]] = {}
    info: dict[str, Any] = {}
    if calibrate or args.predict:
        with Servers(log) as servers:
            url, workers = up(servers, ["--mode", "agg", "--workers", "1"])
            info = engine_info(workers[0])
            for c in calibrate:
                measured[f"agg c{c}"] = measure(url, workers, c, f"agg-c{c}")
            if calibrate:
                # The calibration's engine steps, kept (a refit needs no engine): `bench calibrate --steps steps.json`.
                reply = httpx.get(f"{workers[0]}/steps", headers=token_headers(token), timeout=30).json()
                (out / "steps.json").write_text(json.dumps(reply) + "\n")
                with contextlib.redirect_stdout(io.StringIO()):
                    calibrate_steps(workers, str(profile), token, system="this-machine")
            for c in args.predict:
                measured[f"agg c{c}"] = measure(url, workers, c, f"agg-c{c}")
    if args.disagg_concurrency:
        with Servers(log) as servers:
            url, workers = up(servers, ["--mode", "disagg", "--prefill", "1", "--decode", "1"])
            info = info or engine_info(workers[-1])
            for c in args.disagg_concurrency:
                measured[f"1p1d c{c}"] = measure(url, workers, c, f"1p1d-c{c}")
    if not info:
        raise SystemExit("cpucheck: nothing to measure (no --predict and no --disagg-concurrency with --profile)")
    budget = max(int(info["max_model_len"]), 2048)
    doc["calibration"] = {"profile": str(profile), "reused": reused, "concurrency": calibrate,
                          "budget_tokens": budget, "fit": json.loads(profile.read_text())["source"]["fit"]}
    engine = ["--sim-profile", str(profile), "--block-size", str(info["block_size"]), "--num-gpu-blocks",
              str(info["num_kv_blocks"]), "--max-num-seqs", "64", "--max-num-batched-tokens", str(budget),
              "--no-enable-chunked-prefill"]
    for key, real in measured.items():
        mode, c = key.split()[0], int(key.split("c")[-1])
        pred = predictions(profile, budget, c, "agg" if mode == "agg" else "disagg")
        # The same closed loop through the simulator on the profile (what `plan --simulate` runs).
        layout = ["--mode", "agg", "--workers", "1"] if mode == "agg" else ["--mode", "disagg", "--prefill", "1",
                                                                            "--decode", "1"]
        sim = _sim(layout, engine, model, out / f"{key.replace(' ', '-')}-sim",
                   _workload("fixed", None, max(8, args.rounds * c), c))
        pred["simulated"] = {"ttft_p50": sim["ttft_p50"], "itl_p50": sim["itl_p50"]}
        row: dict[str, Any] = {"measured": real, "predicted": pred,
                               "role": "calibration" if mode == "agg" and c in calibrate else "prediction"}
        for model_name, p in pred.items():
            row[f"error_{model_name}"] = {m: round(p[m] / real[m] - 1, 4) for m in ("ttft_p50", "itl_p50")}
        doc["points"][key] = row
    doc["seconds"] = round(time.monotonic() - t0, 1)
    (out / "cpucheck.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


def table(doc: dict[str, Any]) -> str:
    lines = ["| point | role | measured TTFT / TPOT p50 ms | simulated (error) | closed form, waves (error) | "
             "closed form, steady state: TTFT, TPOT error |", "|---|---|---|---|---|---|"]
    for key, r in doc["points"].items():
        m = r["measured"]

        def cell(name: str) -> str:
            p, e = r["predicted"].get(name), r.get(f"error_{name}")
            if not p:
                return "-"
            return (f"{p['ttft_p50']:.1f} / {p['itl_p50']:.2f} ({e['ttft_p50']:+.0%}, {e['itl_p50']:+.0%})")
        steady = r.get("error_steady")
        st = f"{steady['ttft_p50']:+.0%}, {steady['itl_p50']:+.0%}" if steady else "-"
        lines.append(f"| {key} | {r['role']} | {m['ttft_p50']:.1f} / {m['itl_p50']:.2f} | {cell('simulated')} | "
                     f"{cell('waves')} | {st} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan.cpucheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="artifacts/plan_cpucheck")
    p.add_argument("--calibrate", type=int, nargs="+", default=[1, 4], help="calibration concurrencies (default: 1 4)")
    p.add_argument("--predict", type=int, nargs="*", default=[8, 16],
                   help="aggregated predictions (default: 8 16; none with the flag alone)")
    p.add_argument("--disagg-concurrency", type=int, nargs="*", default=[4, 8],
                   help="1P+1D points (default: 4 8; none with the flag alone)")
    p.add_argument("--profile", help="an earlier run's profile.json: predict on it instead of calibrating "
                                     "(--calibrate is then ignored)")
    p.add_argument("--rounds", type=int, default=6, help="requests per point = rounds x concurrency (default: 6)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
