"""`pdserve bench loadgen-vs-aiperf`: our load generator against AIPerf, side by side in one
run, on the same fake server (`bench fake-server`, 50-token streams).

Three measurements, written to `<out>/bench_loadgen.json`:
  cpu        the same fixed request rate through each tool: CPU-seconds per request of the
             tool's whole process tree (startup included: it is what a user pays), read from
             RUSAGE_CHILDREN around each run;
  max_rate   rising constant request rates: the highest one each tool sustains (achieved
             request throughput >= 95% of the target and no errors);
  agreement  a server with programmed delays (TTFT 50 ms, ITL 5 ms) at concurrency 8: TTFT and
             ITL p50 of both tools and their ratio.
AIPerf runs from its own virtualenv (`make aiperf` makes `.venv-aiperf`), with `--workers-max 2`.
Runs one at a time; nothing else heavy should run meanwhile.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.loadgen.errors import LoadgenError
from serve.common.procs import Child, ChildExited, wait_until_ready
from serve.listen import late_port

OSL = 50
ISL = 64


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _server(*flags: str) -> tuple[Child, str]:
    port = late_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    server = Child("fake-server", [sys.executable, "-m", "serve.cli", "bench", "fake-server", "--port", str(port),
                                   "--osl", str(OSL), *flags], stdout=subprocess.DEVNULL)
    try:
        wait_until_ready(f"{url}/health", [server.popen], 60, poll_s=0.2)
    except (ChildExited, TimeoutError) as e:
        server.stop()
        raise LoadgenError(f"fake server did not start: {e}") from None
    return server, url


def _common(url: str, tokenizer: str, out: Path, n: int) -> list[str]:
    return ["-m", "fake-model", "--tokenizer", tokenizer, "--endpoint-type", "chat", "-u", url,
            "--isl", str(ISL), "--osl", str(OSL), "--streaming", "--extra-inputs", "ignore_eos:true",
            "--num-requests", str(n), "--ui-type", "none", "--artifact-dir", str(out)]


def _run(tool: str, aiperf: str, args: list[str], timeout: float) -> tuple[dict[str, Any], float, float]:
    if tool == "aiperf":
        cmd = [aiperf, "profile", *args, "--workers-max", "2"]
    else:
        cmd = [sys.executable, "-m", "serve.cli", "bench", "profile", *args, "--no-plots"]
    out = Path(args[args.index("--artifact-dir") + 1])
    shutil.rmtree(out, ignore_errors=True)
    cpu0, t0 = _cpu_children(), time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    cpu, wall = _cpu_children() - cpu0, time.monotonic() - t0
    f = out / "profile_export_aiperf.json"
    if proc.returncode != 0 or not f.is_file():
        tail = proc.stdout.decode(errors="replace")[-1500:]
        raise LoadgenError(f"{tool} failed (exit {proc.returncode}): {tail}")
    return json.loads(f.read_text()), cpu, wall


def _avg(doc: dict, tag: str, stat: str = "avg") -> float | None:
    v = doc.get(tag)
    return v.get(stat) if isinstance(v, dict) else None


def run(aiperf: str, out_dir: str, cpu_rate: float, cpu_requests: int, rates_ours: list[float],
        rates_aiperf: list[float], seconds: float) -> dict[str, Any]:
    from bench.loadgen.tokenizer import resolve_tokenizer_source

    if not (Path(aiperf).is_file() and os.access(aiperf, os.X_OK)) and not shutil.which(aiperf):
        raise LoadgenError(f"AIPerf not found at {aiperf}: run `make aiperf` (or pass --aiperf PATH)")
    tokenizer = resolve_tokenizer_source("smollm2-135m-instruct", None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"osl": OSL, "isl": ISL, "machine_cpus": os.cpu_count()}

    server, url = _server()
    try:
        cpu = {}
        for tool in ("aiperf", "pdserve"):
            args = _common(url, tokenizer, out / f"cpu_{tool}", cpu_requests) + [
                "--request-rate", str(cpu_rate), "--arrival-pattern", "constant"]
            doc, c, wall = _run(tool, aiperf, args, 900)
            n = _avg(doc, "request_count") or 0
            cpu[tool] = {"cpu_s": c, "wall_s": wall, "requests": n, "cpu_s_per_request": c / n if n else None,
                         "achieved_rate": _avg(doc, "request_throughput"),
                         "errors": _avg(doc, "error_request_count") or 0}
            print(f"cpu   {tool:8s} rate {cpu_rate:g}/s: {c:.2f} CPU-s for {n:.0f} requests "
                  f"({cpu[tool]['cpu_s_per_request'] * 1000:.2f} ms/request), wall {wall:.1f} s", flush=True)
        cpu["ratio_pdserve_over_aiperf"] = cpu["pdserve"]["cpu_s_per_request"] / cpu["aiperf"]["cpu_s_per_request"]
        report["cpu"] = cpu

        max_rate: dict[str, Any] = {}
        for tool, rates in (("aiperf", rates_aiperf), ("pdserve", rates_ours)):
            runs, best = [], 0.0
            for r in rates:
                n = int(r * seconds)
                args = _common(url, tokenizer, out / f"rate_{tool}_{r:g}", n) + [
                    "--request-rate", str(r), "--arrival-pattern", "constant"]
                try:
                    doc, c, wall = _run(tool, aiperf, args, 900)
                except (LoadgenError, subprocess.TimeoutExpired) as e:
                    runs.append({"target": r, "failed": str(e)[:300]})
                    break
                got = _avg(doc, "request_throughput") or 0.0
                errs = _avg(doc, "error_request_count") or 0
                ok = got >= 0.95 * r and not errs
                runs.append({"target": r, "achieved": got, "errors": errs, "sustained": ok, "cpu_s": c,
                             "ttft_p99_ms": _avg(doc, "time_to_first_token", "p99")})
                print(f"rate  {tool:8s} target {r:7.0f}/s achieved {got:8.1f}/s errors {errs:.0f} "
                      f"{'ok' if ok else 'NOT sustained'}", flush=True)
                if not ok:
                    break
                best = r
            max_rate[tool] = {"max_sustained": best, "runs": runs}
        max_rate["ratio_pdserve_over_aiperf"] = (max_rate["pdserve"]["max_sustained"] /
                                                 max_rate["aiperf"]["max_sustained"]
                                                 if max_rate["aiperf"]["max_sustained"] else None)
        report["max_rate"] = max_rate
    finally:
        server.stop()

    server, url = _server("--ttft-ms", "50", "--itl-ms", "5")
    try:
        agree: dict[str, Any] = {}
        for tool in ("aiperf", "pdserve"):
            args = _common(url, tokenizer, out / f"agree_{tool}", 240) + ["--concurrency", "8",
                                                                          "--num-warmup-requests", "8"]
            doc, _, _ = _run(tool, aiperf, args, 900)
            agree[tool] = {k: _avg(doc, k, "p50") for k in ("time_to_first_token", "inter_token_latency",
                                                            "request_latency")}
            print(f"agree {tool:8s} TTFT p50 {agree[tool]['time_to_first_token']:.2f} ms, "
                  f"ITL p50 {agree[tool]['inter_token_latency']:.3f} ms", flush=True)
        agree["ratio_pdserve_over_aiperf"] = {k: agree["pdserve"][k] / agree["aiperf"][k]
                                              for k in agree["pdserve"] if agree["aiperf"][k]}
        report["agreement"] = agree
    finally:
        server.stop()

    (out / "bench_loadgen.json").write_text(json.dumps(report, indent=2) + "\n")
    c, m, a = report["cpu"], report["max_rate"], report["agreement"]["ratio_pdserve_over_aiperf"]
    print(f"\nCPU-s/request pdserve/aiperf = {c['ratio_pdserve_over_aiperf']:.3f} (target <= 0.5)")
    print(f"max sustained rate: pdserve {m['pdserve']['max_sustained']:g}/s, aiperf {m['aiperf']['max_sustained']:g}/s"
          + (f" = {m['ratio_pdserve_over_aiperf']:.2f}x (target >= 2)" if m["ratio_pdserve_over_aiperf"] else ""))
    print("p50 pdserve/aiperf: " + ", ".join(f"{k} {v:.3f}" for k, v in a.items()) + " (target within 5%)")
    print(f"report: {out / 'bench_loadgen.json'}")
    return report
