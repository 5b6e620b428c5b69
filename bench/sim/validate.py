"""The simulator against real engines: `python -m bench.sim.validate [--out DIR]`.

1. **Calibration, once**: a real aggregated stack (`pdserve up --mode agg`, 1 worker), `bench
   profile` at concurrency 1 and 8 (fixed ISL/OSL, streaming, `ignore_eos`), then
   `bench calibrate --steps` on the worker's engine steps: one `pdserve.profile/1` that
   serves every point below.
2. **Points**, per layout (aggregated 1 worker, aggregated 2 workers, 1 prefill + 1 decode):
   its maximum throughput measured closed-loop (concurrency `--max-concurrency`), then
   constant-rate runs at 30%, 60% and 90% of it with fixed lengths and with spread lengths,
   one with shared prefixes (60%) and one open-loop Poisson (60%). Every real point runs
   twice (from empty prefix caches); `pdserve sim` runs the same workload (same seed, so
   the same prompt lengths and arrivals) on the same layout and engine settings.
3. **Fidelity**: per point, TTFT p50/p90, ITL p50/p90 and output tokens/s of the simulation
   against the mean of the two real runs; the tolerance is max(15%, 1.5 x the real repeat
   spread |a - b| / mean). `<out>/validate.json` and a table on stdout.

Left out of the model, and so in the error: the frontend's and the client's own CPU time
(here they share the two cores with the engines), and the KV transfer of split requests
(the simulated link is instant: on this machine a READ of a 256-token prompt is a few ms
next to a prefill of ~150 ms). Real engines run pinned to a core each, as `pdserve up` does.
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
from pathlib import Path
from typing import Any

from bench.perf.servers import Servers, free_port, pdserve, reset_prefix_cache, url_of
from serve.auth import token_headers

MODEL = "smollm2-135m-instruct"
METRICS = (("ttft_p50", "time_to_first_token", "p50"), ("ttft_p90", "time_to_first_token", "p90"),
           ("itl_p50", "inter_token_latency", "p50"), ("itl_p90", "inter_token_latency", "p90"),
           ("output_tps", "output_token_throughput", "avg"))
LAYOUTS = {"agg1": ["--mode", "agg", "--workers", "1"], "agg2": ["--mode", "agg", "--workers", "2"],
           "1p1d": ["--mode", "disagg", "--prefill", "1", "--decode", "1"]}
ISL, OSL = 256, 64


def _workload(kind: str, rate: float | None, n: int, concurrency: int | None = None) -> list[str]:
    argv = ["--streaming", "--extra-inputs", "ignore_eos:true", "--random-seed", "7", "--num-requests", str(n)]
    if kind == "shared":
        argv += ["--isl", str(ISL // 2), "--osl", str(OSL), "--num-prefix-prompts", "4",
                 "--prefix-prompt-length", str(ISL // 2)]
    else:
        argv += ["--isl", str(ISL), "--osl", str(OSL)]
    if kind == "spread":
        argv += ["--isl-stddev", str(ISL // 4), "--osl-stddev", str(OSL // 4)]
    if rate is not None:
        argv += ["--request-rate", f"{rate:.4f}", "--arrival", "poisson" if kind == "poisson" else "constant"]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    return argv


def _summary(doc: dict[str, Any]) -> dict[str, float]:
    return {name: doc[key][stat] for name, key, stat in METRICS} | {
        "request_tps": doc["request_throughput"]["avg"], "requests": doc["request_count"]["avg"],
        "errors": (doc.get("error_request_count") or {}).get("avg", 0)}


def _real(url: str, tokenizer: str, out: Path, workload: list[str], workers: list[str], token: str) -> dict[str, float]:
    from bench.loadgen.config import add_profile_arguments, config_from_args
    from bench.loadgen.export import write_artifacts
    from bench.loadgen.profile import run as run_profile

    for w in workers:
        reset_prefix_cache(w, token_headers(token))
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    cfg = config_from_args(p.parse_args(["-m", MODEL, "--tokenizer", tokenizer, "-u", url, "--ui-type", "none",
                                         "--artifact-dir", str(out), *workload]))
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_profile(cfg, progress_enabled=False)
        write_artifacts(result, plots=False)
    if result.was_cancelled:  # Ctrl-C or SIGTERM during the run: stop here (the stacks are stopped on the way out)
        raise SystemExit(130)
    return _summary(json.loads((out / "profile_export_aiperf.json").read_text()))


def _sim(layout: list[str], engine: list[str], tokenizer: str, out: Path, workload: list[str]) -> dict[str, float]:
    from bench.loadgen.config import config_from_args
    from bench.sim.cli import add_command
    from bench.sim.options import spec_from_args
    from bench.sim.run import simulate, write

    sub = argparse.ArgumentParser(prog="pdserve").add_subparsers()
    add_command(sub)
    args = sub.choices["sim"].parse_args([*layout, *engine, "-m", MODEL, "--tokenizer", tokenizer, "--ui-type", "none",
                                          "--artifact-dir", str(out), *workload])
    cfg = config_from_args(args, "pdserve sim")
    result, stats = simulate(cfg, spec_from_args(args), progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        write(result, stats)
    return _summary(json.loads((out / "profile_export_aiperf.json").read_text()))


def _worker_urls(frontend: str, token: str) -> list[str]:
    import httpx

    rows = httpx.get(f"{frontend}/internal/workers", headers=token_headers(token), timeout=10).json()["workers"]
    return [r["url"] for r in rows]


def _slowdown(workers: list[str], token: str, profile: Path) -> dict[str, dict[str, float]]:
    """Each worker's engine steps during this layout's runs, measured over the profile's
    prediction for the same batch: above 1 where the engines ran slower than in the
    calibration (CPU shared with another engine, the frontend, the client, KV transfers)."""
    from bench.sim.stepfit import read_steps
    from serve.sim.profile import load as load_profile

    model = load_profile(profile)
    out = {}
    for w in workers:
        steps, meta = read_steps(w, token)
        ratios = sorted(s / model.step_seconds(d, [(c, n) for c, n in p]) for s, d, p in steps
                        if model.step_seconds(d, [(c, n) for c, n in p]) > 0)
        if ratios:
            out[f"{meta['role']} {w}"] = {"steps": len(ratios), "p50": round(ratios[len(ratios) // 2], 4),
                                  "p90": round(ratios[int(0.9 * (len(ratios) - 1))], 4)}
    return out


def compare(real: list[dict[str, float]], sim: dict[str, float]) -> dict[str, Any]:
    """Per metric: the real mean, the simulated value, the error, the repeat spread, the
    tolerance max(15%, 1.5 x spread), and whether the error is within it."""
    out = {}
    for name, _, _ in METRICS:
        a, b = real[0][name], real[-1][name]
        mean = (a + b) / 2
        spread = abs(a - b) / mean if mean else 0.0
        err = sim[name] / mean - 1 if mean else float("inf")
        tol = max(0.15, 1.5 * spread)
        out[name] = {"real": round(mean, 2), "sim": round(sim[name], 2), "error": round(err, 4),
                     "spread": round(spread, 4), "tolerance": round(tol, 4), "ok": abs(err) <= tol}
    return out


def run(args: argparse.Namespace) -> int:
    import httpx

    from bench.sim.stepfit import calibrate_steps
    from serve.model import resolve_model

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = resolve_model(None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "servers.log", "wb")
    token = os.environ.get("PDSERVE_CLUSTER_TOKEN") or secrets.token_hex(16)
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": token}
    t0 = time.monotonic()
    doc: dict[str, Any] = {"simulated_vs_real": True, "isl": ISL, "osl": OSL, "points": {}}

    def up(servers: Servers, layout: list[str]) -> tuple[str, list[str]]:
        port, wport = free_port(), free_port()
        servers.serve("up", pdserve("up", "--port", str(port), "--worker-base-port", str(wport), "--model", model,
                                    "--served-model-name", MODEL, "--ready-timeout", "900", *layout),
                      f"{url_of(port)}/health", env=env, timeout=1200)
        return url_of(port), _worker_urls(url_of(port), token)

    # 1. One calibration: aggregated, 1 worker, concurrency 1 and 8, fixed lengths.
    profile = out / "profile.json"
    with Servers(log) as servers:
        url, workers = up(servers, LAYOUTS["agg1"])
        info = httpx.get(f"{workers[0]}/info", headers=token_headers(token), timeout=10).json()
        for c in (1, 8):
            _real(url, model, out / f"calibrate-c{c}", _workload("fixed", None, 6 * c, c), workers, token)
        with contextlib.redirect_stdout(io.StringIO()) as fit_log:
            calibrate_steps(workers, str(profile), token, system="this-machine")
    print(fit_log.getvalue(), end="", flush=True)
    engine = ["--sim-profile", str(profile), "--block-size", str(info["block_size"]), "--num-gpu-blocks",
              str(info["num_kv_blocks"]), "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
              "--no-enable-chunked-prefill"]
    doc["calibration"] = {"profile": str(profile), "engine": engine,
                          "fit": json.loads(profile.read_text())["source"]["fit"]}
    # 2. Points per layout.
    for name in args.layouts:
        layout = LAYOUTS[name]
        with Servers(log) as servers:
            url, workers = up(servers, layout)
            probe = _real(url, model, out / f"{name}-max", _workload("fixed", None, 4 * args.max_concurrency,
                                                                       args.max_concurrency), workers, token)
            max_rps = probe["request_tps"]
            print(f"{name}: maximum {max_rps:.3f} requests/s (concurrency {args.max_concurrency})", flush=True)
            points = [(kind, frac) for frac in args.loads for kind in ("fixed", "spread")]
            points += [("shared", 0.6), ("poisson", 0.6)]
            for kind, frac in points:
                rate = frac * max_rps
                n = max(12, round(rate * args.seconds))
                workload = _workload(kind, rate, n)
                key = f"{name} {kind} {round(frac * 100)}%"
                real = [_real(url, model, out / f"{name}-{kind}-{round(frac * 100)}-{i}", workload, workers, token)
                        for i in range(2)]
                sim = _sim(layout, engine, model, out / f"{name}-{kind}-{round(frac * 100)}-sim", workload)
                row = {"rate": round(rate, 4), "requests": n, "real": real, "sim": sim, "fidelity": compare(real, sim)}
                doc["points"][key] = row
                print(line(key, row), flush=True)
                (out / "validate.json").write_text(json.dumps(doc, indent=1) + "\n")
            doc.setdefault("step_slowdown", {})[name] = _slowdown(workers, token, profile)
            print(f"{name}: engine steps measured / the profile's prediction, median (p90): "
                  + ", ".join(f"{w}: {v['p50']:.3f} ({v['p90']:.3f}), {v['steps']} steps"
                              for w, v in doc["step_slowdown"][name].items()), flush=True)
    doc["seconds"] = round(time.monotonic() - t0, 1)
    (out / "validate.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    print(f"written: {out / 'validate.json'}")
    return 0


def line(key: str, row: dict[str, Any]) -> str:
    f = row["fidelity"]
    cells = "  ".join(f"{m} {f[m]['error'] * 100:+.1f}%{'' if f[m]['ok'] else '!'}" for m, _, _ in METRICS)
    return f"{key:<24} {cells}"


def table(doc: dict[str, Any]) -> str:
    lines = ["| point | rate req/s | " + " | ".join(f"{m} real / sim (err, tol)" for m, _, _ in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for key, row in doc["points"].items():
        cells = []
        for m, _, _ in METRICS:
            f = row["fidelity"][m]
            cells.append(f"{f['real']:.1f} / {f['sim']:.1f} ({f['error'] * 100:+.1f}%, {f['tolerance'] * 100:.0f}%)"
                         + ("" if f["ok"] else " **miss**"))
        lines.append(f"| {key} | {row['rate']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="artifacts/sim_validate")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--loads", nargs="+", type=float, default=[0.3, 0.6, 0.9],
                    help="fractions of the measured maximum throughput (default: 0.3 0.6 0.9)")
    ap.add_argument("--max-concurrency", type=int, default=16,
                    help="closed-loop concurrency that measures a layout's maximum (default: 16)")
    ap.add_argument("--seconds", type=float, default=30.0, help="about how long each real run sends (default: 30)")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
