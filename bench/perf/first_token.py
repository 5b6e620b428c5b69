"""`pdserve bench first-token`: what streaming the prefill's own first token buys.

One run, real engines by default (`--engine sim` for simulated ones, labelled so):
1. an aggregated stack (`pdserve up --mode agg`, one worker);
2. a disaggregated stack (`pdserve up --mode disagg`, 1 prefill + 1 decode) whose frontend
   streams the prefill's token (`--first-token-from prefill`), and beside it a second
   frontend on the same two workers with `--first-token-from decode` (the old path).
At each ISL (default 256, 1000, 4000) `pdserve bench profile` runs the same seeded synthetic
prompts, every run from empty prefix caches on every worker, at concurrency 1 (greedy, streaming, `ignore_eos`, OSL 32): on the aggregated stack,
then new, old, old, new on the disaggregated one (so a drift of the machine falls on both
paths alike), then at `--concurrency-high` (default 4) new and old once each. Batching
changes CPU arithmetic too, so at that level the aggregated stack runs twice first: how
many answers its two runs share is the baseline beside which the disaggregated paths'
agreement with its first run is read.

`<out>/bench_first_token.json` (and a table on stdout): per ISL, TTFT p50, time to second
token p50 and output tokens/s for each path, the ratios disagg/agg (target: TTFT <= 1.05x
with the new path), new/old, and how many answers equal the aggregated ones, request by
request (greedy: they should all be equal with the new path); at the higher concurrency,
the same agreement for both paths beside the aggregated-vs-aggregated baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any


from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, reset_prefix_cache, url_of
from serve.auth import token_headers

MODEL = "smollm2-135m-instruct"


def add_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("first-token", help="disaggregated TTFT with the prefill's first token streamed vs the "
                                            "decode worker regenerating it, beside aggregated (one run)",
                        description=__doc__.split("\n\n")[0] if __doc__ else None)
    s.add_argument("--engine", choices=["vllm", "sim"], default="vllm",
                   help="workers: real vLLM engines (default) or simulated ones")
    s.add_argument("--isl", type=int, nargs="+", default=[256, 1000, 4000], help="prompt lengths (default: 256 1000 4000)")
    s.add_argument("--osl", type=int, default=32, help="output tokens (default: 32)")
    s.add_argument("--requests", type=int, default=8, help="requests per client run (default: 8)")
    s.add_argument("--concurrency-high", type=int, default=4,
                   help="the second load level, new vs old path (default: 4; 0 skips it)")
    s.add_argument("--sim-step-model", default="linear:0.01,0.0001,0.00005",
                   help="--engine sim: the workers' step model (default: linear:0.01,0.0001,0.00005)")
    s.add_argument("--kv-cache-dtype", default=None,
                   help="KV cache dtype of every worker, aggregated ones too (e.g. fp8; default: the model's)")
    s.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    s.add_argument("--out", default="artifacts/bench_first_token", help="output folder")


def _fresh(workers: list[str], token: str) -> None:
    """Empty every worker's prefix cache: each run starts from the same cache state (the runs
    send the same seeded prompts, which a warm cache would serve without computing)."""
    for url in workers:
        reset_prefix_cache(url, token_headers(token))


def _profile(url: str, tokenizer: str, out: Path, isl: int, osl: int, n: int, concurrency: int,
             workers: list[str], token: str) -> dict[str, Any]:
    """One `pdserve bench profile` run from empty prefix caches: its p50s, throughput and
    answers by request."""
    _fresh(workers, token)
    from bench.loadgen.config import add_profile_arguments, config_from_args
    from bench.loadgen.export import write_artifacts
    from bench.loadgen.profile import run as run_profile

    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    cfg = config_from_args(p.parse_args([
        "-m", MODEL, "--tokenizer", tokenizer, "-u", url, "--ui-type", "none", "--artifact-dir", str(out),
        "--isl", str(isl), "--osl", str(osl), "--num-requests", str(n), "--concurrency", str(concurrency),
        "--streaming", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--random-seed", "7", "--num-warmup-requests", "1"]))
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_profile(cfg, progress_enabled=False)
        m = write_artifacts(result, plots=False)
    if result.was_cancelled:  # Ctrl-C or SIGTERM during the run: stop here (the stacks are stopped on the way out)
        raise SystemExit(130)
    bad = [r for r in result.records if not r.ok]
    if bad:
        raise PerfError(f"{url}: {len(bad)} of {len(result.records)} requests failed: {bad[0].error}")
    return {"ttft_p50_ms": m["time_to_first_token"]["p50"], "ttst_p50_ms": m["time_to_second_token"]["p50"],
            "output_tps": m["output_token_throughput"]["avg"],
            "server_ttft_p50_ms": (m.get("server_ttft") or {}).get("p50"),
            "answers": {f"{r.session}-{r.turn}": r.text for r in result.records}}


def _up(servers: Servers, args: argparse.Namespace, model: str, mode: str, port: int, wport: int,
        env: dict[str, str]) -> None:
    cmd = pdserve("up", "--port", str(port), "--worker-base-port", str(wport), "--model", model,
                  "--served-model-name", MODEL, "--mode", mode, "--max-num-seqs", "8", "--ready-timeout", "600")
    if args.engine == "sim":
        cmd += ["--engine", "sim", "--sim-step-model", args.sim_step_model]
    if args.kv_cache_dtype:
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    servers.serve(f"up-{mode}", cmd, f"{url_of(port)}/health", env=env, timeout=900)


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def _agree(a: dict[str, str], b: dict[str, str]) -> str:
    same = sum(1 for k in a if k in b and a[k] == b[k])
    return f"{same}/{len(a)}"


def run(args: argparse.Namespace) -> int:
    from serve.model import resolve_model

    # SIGTERM (a timeout, a supervisor) unwinds like Ctrl-C, so the stacks below are stopped:
    # Python's default SIGTERM action would leave them running, each in its own group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "servers.log", "wb")
    rows: dict[int, dict[str, Any]] = {}
    agg_hi: dict[int, list[dict[str, Any]]] = {}  # the aggregated stack's two runs at --concurrency-high
    t0 = time.monotonic()
    # One cluster token for the stack and the second frontend on its workers.
    token = os.environ.get("PDSERVE_CLUSTER_TOKEN") or secrets.token_hex(16)
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": token}
    with Servers(log) as servers:
        port, wport = free_port(), free_port()
        _up(servers, args, model, "agg", port, wport, env)
        for isl in args.isl:
            rows[isl] = {"agg": _profile(url_of(port), model, out / f"agg-{isl}", isl, args.osl, args.requests, 1,
                                         [url_of(wport)], token)}
            if args.concurrency_high:
                c = args.concurrency_high
                agg_hi[isl] = [_profile(url_of(port), model, out / f"agg-{isl}-c{c}-{i}", isl, args.osl,
                                        args.requests * 2, c, [url_of(wport)], token) for i in range(2)]
    with Servers(log) as servers:
        port, wport = free_port(), free_port()
        _up(servers, args, model, "disagg", port, wport, env)
        old_port = free_port()
        servers.serve("frontend-first-token-from-decode", pdserve(
            "frontend", "--port", str(old_port), "--model", model, "--served-model-name", MODEL,
            "--worker", url_of(wport), "--worker", url_of(wport + 1), "--first-token-from", "decode"),
            f"{url_of(old_port)}/health", env=env, timeout=300)
        new, old = url_of(port), url_of(old_port)
        workers = [url_of(wport), url_of(wport + 1)]
        for isl in args.isl:
            runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
            for i, (name, url) in enumerate((("new", new), ("old", old), ("old", old), ("new", new))):
                runs[name].append(_profile(url, model, out / f"{name}-{isl}-{i}", isl, args.osl, args.requests, 1,
                                           workers, token))
            row = rows[isl]
            agg = row["agg"]
            for name in ("new", "old"):
                row[name] = {k: _mean(runs[name], k) for k in ("ttft_p50_ms", "ttst_p50_ms", "output_tps")}
                row[name]["same_answers_as_agg"] = _agree(agg["answers"], runs[name][0]["answers"])
                row[name]["ttft_vs_agg"] = row[name]["ttft_p50_ms"] / agg["ttft_p50_ms"]
                row[name]["ttst_vs_agg"] = row[name]["ttst_p50_ms"] / agg["ttst_p50_ms"]
            row["ttft_new_vs_old"] = row["new"]["ttft_p50_ms"] / row["old"]["ttft_p50_ms"]
            if args.concurrency_high:
                c = args.concurrency_high
                hi = {name: _profile(url, model, out / f"{name}-{isl}-c{c}", isl, args.osl, args.requests * 2, c,
                                     workers, token)
                      for name, url in (("new", new), ("old", old))}
                base = agg_hi[isl][0]["answers"]
                row[f"c{c}"] = {name: {**{k: v for k, v in r.items() if k != "answers"},
                                       "same_answers_as_agg": _agree(base, r["answers"])} for name, r in hi.items()}
                row[f"c{c}"]["agg"] = {**{k: v for k, v in agg_hi[isl][0].items() if k != "answers"},
                                       "same_answers_as_agg": _agree(base, agg_hi[isl][1]["answers"])}
            agg.pop("answers")
    doc = {"engine": args.engine, "simulated": args.engine == "sim", "kv_cache_dtype": args.kv_cache_dtype or "auto",
           "osl": args.osl, "requests": args.requests, "concurrency_high": args.concurrency_high,
           "seconds": round(time.monotonic() - t0, 1), "by_isl": rows}
    (out / "bench_first_token.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    print(f"written: {out / 'bench_first_token.json'}")
    return 0


def table(doc: dict[str, Any]) -> str:
    lines = [f"first token from the prefill ({'SIMULATED workers' if doc['simulated'] else 'vLLM engines'}), "
             f"KV {doc['kv_cache_dtype']}, concurrency 1, OSL {doc['osl']}",
             "| ISL | agg TTFT p50 ms | new TTFT | old TTFT | new/agg | old/agg | TTST new/agg | TTST old/agg "
             "| same answers new | old |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for isl, row in doc["by_isl"].items():
        a, n, o = row["agg"], row["new"], row["old"]
        lines.append(f"| {isl} | {a['ttft_p50_ms']:.1f} | {n['ttft_p50_ms']:.1f} | {o['ttft_p50_ms']:.1f} | "
                     f"{n['ttft_vs_agg']:.3f} | {o['ttft_vs_agg']:.3f} | {n['ttst_vs_agg']:.3f} | "
                     f"{o['ttst_vs_agg']:.3f} | {n['same_answers_as_agg']} | {o['same_answers_as_agg']} |")
    c = doc.get("concurrency_high")
    if c:
        lines += ["", f"concurrency {c}: answers equal to the aggregated stack's first run "
                  "(agg: its second run, the baseline), TTFT p50 ms, output tokens/s",
                  "| ISL | agg vs agg | new | old | TTFT agg | new | old | tok/s agg | new | old |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for isl, row in doc["by_isl"].items():
            h = row[f"c{c}"]
            lines.append(f"| {isl} | {h['agg']['same_answers_as_agg']} | {h['new']['same_answers_as_agg']} | "
                         f"{h['old']['same_answers_as_agg']} | {h['agg']['ttft_p50_ms']:.1f} | "
                         f"{h['new']['ttft_p50_ms']:.1f} | {h['old']['ttft_p50_ms']:.1f} | "
                         f"{h['agg']['output_tps']:.1f} | {h['new']['output_tps']:.1f} | {h['old']['output_tps']:.1f} |")
    return "\n".join(lines)
