"""pdserve's frontend against NVIDIA Dynamo's (Rust) frontend, each in front of a simulated
engine, at the same request rates and lengths, in one run.

    python -m bench.perf.frontend_peers [--dynamo-venv .venv-dynamo] [--cpu-rate 20]
        [--rates 10 20 40 80 ...] [--seconds 12] [--out artifacts/frontend_peers]

- Dynamo: `python -m dynamo.frontend` + `python -m dynamo.mocker` (Dynamo 1.6.1, `make dynamo`),
  without etcd or NATS: `--discovery-backend file --request-plane tcp --event-plane zmq`.
- pdserve: `pdserve frontend` + one simulated worker (`pdserve worker --engine sim`).
The engines are paced alike: the mocker models its engine (`--mocker-speedup`, default 1:
~6-9 ms between tokens here), pdserve's simulated worker steps every `--step-ms` (default 6);
the ITL each achieved is in the report, so the two backends' pace can be checked (the mocker
at speed-up 0, no delay at all, would make the comparison a spin). The mocker binds all
interfaces, so everything (servers and client) runs in a private network namespace
(`unshare -n`, loopback only); the script re-executes itself there.

The client is `pdserve bench profile` (streaming chat, ISL `--isl`, OSL `--osl` with
ignore_eos, constant arrivals). Measured for each frontend: its process's CPU-seconds per
request at `--cpu-rate` (psutil, the frontend's process tree only: not the engine, not the
client), and the highest sustained rate among `--rates` (achieved >= 95% of the target,
no errors). Writes `frontend_peers.json` and `frontend_peers.md` in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.perf.errors import PerfError
from bench.perf.frontend_overhead import MODEL_NAME
from bench.perf.rate_run import rate_run
from bench.perf.servers import Servers, free_port, pdserve, url_of

INSIDE = "PDSERVE_PEERS_NETNS"


def start_dynamo(args: argparse.Namespace, model: str, servers: Servers, store: Path) -> tuple[str, dict[int, str]]:
    py = str(Path(args.dynamo_venv) / "bin" / "python")
    env = {**os.environ, "DYN_FILE_KV": str(store), "DYN_LOG": "warn"}
    common = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    port = free_port()
    servers.start("dynamo mocker", [py, "-m", "dynamo.mocker", "--model-path", model, "--model-name", MODEL_NAME,
                                    "--speedup-ratio", str(args.mocker_speedup), *common], env=env)
    url = url_of(port)
    f = servers.serve("dynamo frontend", [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                          "--http-port", str(port), *common], f"{url}/health", env=env)
    wait_model(url, servers, args.start_timeout)
    return url, {f.popen.pid: "frontend"}


def start_pdserve(args: argparse.Namespace, model: str, servers: Servers) -> tuple[str, dict[int, str]]:
    fport, wport = free_port(), free_port()
    url, worker = url_of(fport), url_of(wport)
    # The frontend's /health waits for a worker in rotation: start it, then the worker.
    f = servers.start("pdserve frontend", pdserve("frontend", "--port", str(fport), "--model", model,
                                                  "--served-model-name", MODEL_NAME, "--log-level", "warning"))
    servers.serve("pdserve sim worker", pdserve(
        "worker", "--engine", "sim", "--port", str(wport), "--model", model, "--served-model-name", MODEL_NAME,
        "--frontend", url, "--log-level", "warning", "--sim-step-model", f"constant:{args.step_ms / 1000:g}",
        "--max-num-seqs", "256"), f"{worker}/health")
    wait_model(url, servers, args.start_timeout)
    return url, {f.popen.pid: "frontend"}


def wait_model(url: str, servers: Servers, timeout: float) -> None:
    """Until a chat request through the frontend succeeds (the worker registered)."""
    import httpx

    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise PerfError(f"{url}: no model served after {timeout:.0f}s ({last}); log {servers.log.name}")


def one_rate(args: argparse.Namespace, name: str, url: str, roots: dict[int, str], tokenizer: str, out: Path,
             rate: float) -> dict[str, Any]:
    row = rate_run(url, roots, tokenizer, out, rate, args.seconds, args.isl, args.osl, args.seconds * 10 + 120)
    return {"frontend": name, **row}


def run_inside(args: argparse.Namespace) -> int:
    from bench.loadgen.tokenizer import resolve_tokenizer_source
    from serve.model import resolve_model

    model = resolve_model(args.model)
    tokenizer = resolve_tokenizer_source(MODEL_NAME, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"isl": args.isl, "osl": args.osl, "step_ms": args.step_ms,
                              "mocker_speedup_ratio": args.mocker_speedup, "cpu_rate": args.cpu_rate,
                              "seconds": args.seconds, "machine_cpus": os.cpu_count(), "cpu": {}, "max_rate": {}}
    with open(out / "servers.log", "wb") as log, tempfile.TemporaryDirectory(prefix="dynkv-") as store:
        for name in ("dynamo", "pdserve"):
            with Servers(log) as servers:
                url, roots = (start_dynamo(args, model, servers, Path(store)) if name == "dynamo"
                              else start_pdserve(args, model, servers))
                cpu = one_rate(args, name, url, roots, tokenizer, out / f"{name}_cpu", args.cpu_rate)
                report["cpu"][name] = cpu
                print(f"{name:8s} cpu @ {args.cpu_rate:g}/s: {json.dumps(cpu)}", flush=True)
                rows, best = [], 0.0
                for r in args.rates:
                    row = one_rate(args, name, url, roots, tokenizer, out / f"{name}_rate_{r:g}", r)
                    rows.append(row)
                    print(f"{name:8s} rate {r:g}/s: achieved {row.get('achieved', 0):.1f}/s errors "
                          f"{row.get('errors', '-')} {'ok' if row.get('sustained') else 'NOT sustained'}", flush=True)
                    if not row.get("sustained"):
                        break
                    best = r
                report["max_rate"][name] = {"runs": rows, "highest_sustained": best}
    d, p = report["cpu"]["dynamo"], report["cpu"]["pdserve"]
    if d.get("frontend_cpu_ms_per_request") and p.get("frontend_cpu_ms_per_request"):
        report["cpu_ratio_pdserve_over_dynamo"] = p["frontend_cpu_ms_per_request"] / d["frontend_cpu_ms_per_request"]
    (out / "frontend_peers.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(report)
    (out / "frontend_peers.md").write_text(text)
    print("\n" + text)
    return 0


def table(rep: dict[str, Any]) -> str:
    lines = [f"Frontends in front of simulated engines (step {rep['step_ms']} ms; mocker speed-up "
             f"{rep['mocker_speedup_ratio']}), ISL {rep['isl']}, OSL {rep['osl']} streamed, constant arrivals, "
             f"client pdserve bench profile", "",
             "| frontend | CPU ms/request @ {:g}/s | ITL p50 ms | TTFT p50 ms | highest sustained rate |".format(
                 rep["cpu_rate"]), "|---|---|---|---|---|"]
    for name in ("dynamo", "pdserve"):
        c = rep["cpu"][name]
        cpu = c.get("frontend_cpu_ms_per_request")
        lines.append(f"| {name} | {cpu:.2f} | {c.get('itl_p50_ms') or float('nan'):.2f} | "
                     f"{c.get('ttft_p50_ms') or float('nan'):.2f} | {rep['max_rate'][name]['highest_sustained']:g}/s |"
                     if cpu is not None else f"| {name} | failed: {c.get('failed', '?')[:80]} | | | |")
    if "cpu_ratio_pdserve_over_dynamo" in rep:
        lines += ["", f"pdserve / Dynamo frontend CPU per request: {rep['cpu_ratio_pdserve_over_dynamo']:.2f}x"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perf.frontend_peers", description=__doc__.splitlines()[0])
    ap.add_argument("--dynamo-venv", default=".venv-dynamo", help="Dynamo's virtualenv (`make dynamo`)")
    ap.add_argument("--cpu-rate", type=float, default=20.0, help="request rate of the CPU comparison (default: 20)")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 20, 40, 60, 80, 120, 160, 240, 320],
                    help="rising request rates for the highest sustained rate")
    ap.add_argument("--seconds", type=float, default=12.0, help="length of each run (default: 12)")
    ap.add_argument("--isl", type=int, default=64, help="prompt tokens (default: 64)")
    ap.add_argument("--osl", type=int, default=50, help="output tokens, streamed (default: 50)")
    ap.add_argument("--step-ms", type=float, default=6.0,
                    help="pdserve simulated engine step (default: 6 ms, the mocker's measured ITL at speed-up 1)")
    ap.add_argument("--mocker-speedup", type=float, default=1.0, help="Dynamo mocker --speedup-ratio (default: 1)")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--out", default="artifacts/frontend_peers")
    args = ap.parse_args(argv)
    py = Path(args.dynamo_venv) / "bin" / "python"
    if not py.exists():
        print(f"bench.perf.frontend_peers: error: no Dynamo at {args.dynamo_venv}: run `make dynamo`", file=sys.stderr)
        return 2
    if os.environ.get(INSIDE) != "1":
        if shutil.which("unshare") is None or shutil.which("ip") is None:
            print("bench.perf.frontend_peers: error: needs `unshare` and `ip` (a private network namespace)",
                  file=sys.stderr)
            return 2
        script = "ip link set lo up && exec \"$@\""
        cmd = ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, "-m", "bench.perf.frontend_peers",
               *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env={**os.environ, INSIDE: "1"})
    try:
        return run_inside(args)
    except PerfError as e:
        print(f"bench.perf.frontend_peers: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
