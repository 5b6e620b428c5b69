"""`pdserve bench frontend-overhead`: pdserve aggregated (one worker) against vLLM's own
OpenAI server, same model and engine settings, driven by an outside client, in one run.

    pdserve bench frontend-overhead [--client aiperf|pdserve] [--concurrency 1 16 32]
        [--isl 200] [--osl 64] [--profile-concurrency 16] [--out DIR]
    python -m bench.frontend_overhead ...   (the same, as the README's older name)

Both servers get the issue's engine settings: `--enforce-eager --no-enable-chunked-prefill
--max-num-seqs 64`, the engine core pinned to core 0, a 2 GiB KV cache. They run alone, in
the order vLLM, pdserve, pdserve, vLLM (a drift of this shared machine's speed over the run
hits both sides alike). The client is AIPerf (`make aiperf`; `--client pdserve` uses our own
`pdserve bench profile` with the same flags), streaming chat, ISL/OSL fixed, `ignore_eos`.

Per server, pass and concurrency: output tokens/s, ITL p50, TTFT p50 (the client's), and the
CPU-seconds each process of the server used during the run (psutil, whole process trees):
the engine core, and everything on the request's path that is not the engine (vLLM's API
server; pdserve's frontend and worker API), per request. With `--profile-concurrency C` one
more pass of each server at concurrency C runs `py-spy record` on its non-engine processes
(kept out of the ratios: the profiler's own CPU would bias them); the collapsed stacks and a
summary of the top functions are kept.

Writes `<out>/frontend_overhead.json` (every run, then the ratios pdserve / vLLM at each
concurrency, means over the two passes) and `<out>/frontend_overhead.md` (the table).
Targets (issue 18): output tokens/s >= 0.97x vLLM's and ITL p50 <= 1.03x at 16 and 32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, url_of
from serve.cpu_attention import DEFAULT as CPU_ATTN_DEFAULT, ENV as CPU_ATTN_ENV

MODEL_NAME = "smollm2-135m-instruct"
ORDER = ("vllm", "pdserve", "pdserve", "vllm")
ENGINE_FLAGS = ["--enforce-eager", "--no-enable-chunked-prefill"]


def cpu_env() -> dict[str, str]:
    return {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_NO_USAGE_STATS": "1",
            # the same attention kernel as pdserve's workers (serve.cpu_attention), vLLM's server too
            CPU_ATTN_ENV: os.environ.get(CPU_ATTN_ENV, CPU_ATTN_DEFAULT)}


def start_vllm(model: str, servers: Servers, args: argparse.Namespace) -> tuple[str, dict[int, str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS,
           "--max-num-seqs", str(args.max_num_seqs), "--disable-uvicorn-access-log", "--disable-log-stats"]
    url = url_of(port)
    env = {**cpu_env(), "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    child = servers.serve("vllm", cmd, f"{url}/health", env=env)
    return url, {child.popen.pid: "api_server"}


def start_pdserve(model: str, servers: Servers, args: argparse.Namespace) -> tuple[str, dict[int, str]]:
    wport, fport = free_port(), free_port()
    worker = url_of(wport)
    w = servers.serve("pdserve worker", pdserve(
        "worker", "--port", str(wport), "--model", model, "--served-model-name", MODEL_NAME, "--cpu-cores", "0",
        "--kv-cache-gib", str(args.kv_cache_gib), "--log-level", "warning", *ENGINE_FLAGS,
        "--max-num-seqs", str(args.max_num_seqs)), f"{worker}/health", env=cpu_env())
    url = url_of(fport)
    f = servers.serve("pdserve frontend", pdserve("frontend", "--port", str(fport), "--model", model,
                                                  "--served-model-name", MODEL_NAME, "--worker", worker,
                                                  "--log-level", "warning"), f"{url}/health", env=cpu_env())
    return url, {w.popen.pid: "worker_api", f.popen.pid: "frontend"}


# -- CPU accounting -----------------------------------------------------------------------
def _is_engine(proc: psutil.Process) -> bool:
    import psutil  # vLLM's dependency: imported only when the benchmark runs

    try:
        # vLLM titles its engine processes VLLM::EngineCore and VLLM::Worker (the model runner)
        return proc.name().startswith("VLLM::") or "EngineCore" in " ".join(proc.cmdline()[:2])
    except psutil.Error:
        return False


def processes(roots: dict[int, str]) -> dict[int, tuple[psutil.Process, str]]:
    """Every live process of the server trees: pid -> (process, role); vLLM's engine core and
    model runner processes are "engine", the rest take their root's role."""
    import psutil

    found: dict[int, tuple[psutil.Process, str]] = {}
    for pid, role in roots.items():
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            found[proc.pid] = (proc, "engine" if _is_engine(proc) else role)
    return found


def cpu_by_process(procs: dict[int, tuple[psutil.Process, str]]) -> dict[int, float]:
    import psutil  # vLLM's dependency: imported only when the benchmark runs

    out = {}
    for pid, (proc, _) in procs.items():
        try:
            t = proc.cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_by_role(procs: dict[int, tuple[psutil.Process, str]], before: dict[int, float],
                after: dict[int, float]) -> dict[str, float]:
    roles: Counter[str] = Counter()
    for pid, (_, role) in procs.items():
        if pid in after:
            roles[role] += after[pid] - before.get(pid, 0.0)
    return {k: round(v, 3) for k, v in roles.items()}


# -- py-spy -------------------------------------------------------------------------------
def start_profilers(procs: dict[int, tuple[psutil.Process, str]], out: Path, py_spy: str) -> list[subprocess.Popen]:
    spies = []
    for pid, (_, role) in procs.items():
        if role == "engine" or not _is_python_root(procs, pid):
            continue
        f = out / f"pyspy_{role}_{pid}.txt"
        spies.append(subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                                       "--nonblocking", "--output", str(f)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def _is_python_root(procs: dict[int, tuple[psutil.Process, str]], pid: int) -> bool:
    """The main Python process of a role (not a helper such as multiprocessing's resource tracker)."""
    import psutil

    proc, role = procs[pid]
    try:
        parent = proc.ppid()
    except psutil.Error:
        return False
    return parent not in procs or procs[parent][1] != role


def stop_profilers(spies: list[subprocess.Popen]) -> None:
    for s in spies:
        s.send_signal(signal.SIGINT)
    for s in spies:
        try:
            s.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait(timeout=5)


def summarise_stacks(path: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample counts per function from py-spy's collapsed stacks."""
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        k = int(n)
        total += k
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        if frames:
            self_t[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    share = (lambda c: [(f, round(100 * v / total, 1)) for f, v in c.most_common(top)]) if total else (lambda c: [])
    return {"samples": total, "self_percent": share(self_t), "inclusive_percent": share(incl)}


# -- the client ---------------------------------------------------------------------------
def client_cmd(args: argparse.Namespace, url: str, tokenizer: str, out: Path, concurrency: int) -> list[str]:
    n = max(args.requests, args.requests_per_client * concurrency)
    common = ["-m", MODEL_NAME, "--tokenizer", tokenizer, "--endpoint-type", "chat", "-u", url,
              "--isl", str(args.isl), "--osl", str(args.osl), "--streaming", "--extra-inputs", "ignore_eos:true",
              "--num-requests", str(n), "--concurrency", str(concurrency), "--ui-type", "none",
              "--artifact-dir", str(out), "--random-seed", "0"]
    if args.client == "aiperf":
        return [args.aiperf, "profile", *common, "--workers-max", "2"]
    return [*pdserve("bench", "profile"), *common, "--no-plots"]


def run_client(cmd: list[str], out: Path, timeout: float, fresh: bool = True) -> dict[str, Any]:
    """Run a client writing its artifacts in `out` (emptied first unless `fresh` is False:
    the caller did, and put its own files there)."""
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "client.log", "wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
    doc_path = out / "profile_export_aiperf.json"
    if proc.returncode != 0 or not doc_path.is_file():
        tail = (out / "client.log").read_text(errors="replace")[-1200:]
        raise PerfError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}); log {out / 'client.log'}: {tail}")
    return json.loads(doc_path.read_text())


def _stat(doc: dict, tag: str, stat: str) -> float | None:
    v = doc.get(tag)
    return float(v[stat]) if isinstance(v, dict) and v.get(stat) is not None else None


def measure(name: str, roots: dict[int, str], args: argparse.Namespace, url: str, tokenizer: str, out: Path,
            concurrency: int, profile: bool) -> dict[str, Any]:
    procs = processes(roots)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spies = start_profilers(procs, out, args.py_spy) if profile else []
    before, t0 = cpu_by_process(procs), time.monotonic()
    try:
        doc = run_client(client_cmd(args, url, tokenizer, out, concurrency), out, args.run_timeout, fresh=False)
    finally:
        after, wall = cpu_by_process(procs), time.monotonic() - t0
        stop_profilers(spies)
    cpu = cpu_by_role(procs, before, after)
    n = _stat(doc, "request_count", "avg") or 0.0
    path_cpu = sum(v for k, v in cpu.items() if k != "engine")
    row = {"server": name, "concurrency": concurrency, "requests": n, "wall_s": round(wall, 2),
           "errors": _stat(doc, "error_request_count", "avg") or 0.0,
           "output_tokens_per_s": _stat(doc, "output_token_throughput", "avg"),
           "itl_p50_ms": _stat(doc, "inter_token_latency", "p50"),
           "ttft_p50_ms": _stat(doc, "time_to_first_token", "p50"),
           "cpu_s": cpu, "path_cpu_ms_per_request": round(1000 * path_cpu / n, 3) if n else None}
    if profile:
        row["profiles"] = {f.name: summarise_stacks(f) for f in sorted(out.glob("pyspy_*.txt"))}
    return row


# -- the run ------------------------------------------------------------------------------
def ratios(runs: list[dict[str, Any]], levels: list[int]) -> list[dict[str, Any]]:
    rows = []
    for c in levels:
        side = {s: [r for r in runs if r["server"] == s and r["concurrency"] == c and not r.get("profiled")]
                for s in ("vllm", "pdserve")}
        if not side["vllm"] or not side["pdserve"]:
            continue
        mean = {s: {k: statistics.mean(r[k] for r in rs) for k in ("output_tokens_per_s", "itl_p50_ms",
                                                                     "ttft_p50_ms", "path_cpu_ms_per_request")}
                for s, rs in side.items()}
        row: dict[str, Any] = {"concurrency": c, "vllm": mean["vllm"], "pdserve": mean["pdserve"]}
        for k in ("output_tokens_per_s", "itl_p50_ms", "ttft_p50_ms", "path_cpu_ms_per_request"):
            row[f"{k}_ratio"] = mean["pdserve"][k] / mean["vllm"][k] if mean["vllm"][k] else None
        rows.append(row)
    return rows


def table(summary: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"pdserve agg (1 worker) / vLLM's OpenAI server, {args.client} client, ISL {args.isl}, OSL {args.osl} "
             f"(ignore_eos), order {'/'.join(ORDER)}; means of two passes each", "",
             "| concurrency | output tok/s pdserve / vLLM | ITL p50 | TTFT p50 | "
             "non-engine CPU ms/request pdserve / vLLM |",
             "|---|---|---|---|---|"]
    for r in summary:
        p, v = r["pdserve"], r["vllm"]
        lines.append(f"| {r['concurrency']} | {r['output_tokens_per_s_ratio']:.3f} ({p['output_tokens_per_s']:.1f} / "
                     f"{v['output_tokens_per_s']:.1f}) | {r['itl_p50_ms_ratio']:.3f} ({p['itl_p50_ms']:.2f} / "
                     f"{v['itl_p50_ms']:.2f} ms) | {r['ttft_p50_ms_ratio']:.3f} ({p['ttft_p50_ms']:.1f} / "
                     f"{v['ttft_p50_ms']:.1f} ms) | {r['path_cpu_ms_per_request_ratio']:.2f} "
                     f"({p['path_cpu_ms_per_request']:.1f} / {v['path_cpu_ms_per_request']:.1f}) |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from bench.loadgen.tokenizer import resolve_tokenizer_source
    from serve.model import resolve_model

    if min(args.isl, args.osl, args.requests, args.requests_per_client) < 1 or min(args.concurrency) < 1:
        raise PerfError("--isl, --osl, --requests, --requests-per-client and --concurrency must be >= 1")
    if args.client == "aiperf" and not (shutil.which(args.aiperf) or os.access(args.aiperf, os.X_OK)):
        raise PerfError(f"AIPerf not found at {args.aiperf}: run `make aiperf` (or pass --aiperf PATH, or "
                        "--client pdserve)")
    if args.profile_concurrency is not None:
        args.py_spy = shutil.which(args.py_spy) or (args.py_spy if os.access(args.py_spy, os.X_OK) else None)
        if args.py_spy is None:
            raise PerfError("--profile-concurrency needs py-spy: run `make py-spy` (or pass --py-spy PATH)")
    model = resolve_model(args.model)
    tokenizer = resolve_tokenizer_source(MODEL_NAME, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    # The measured passes, then (with --profile-concurrency) one more pass per server at that
    # concurrency under py-spy, kept out of the ratios: the profiler costs CPU on the shared
    # core, and pdserve has two processes to sample where vLLM has one.
    passes = [(name, args.concurrency, False) for name in ORDER]
    if args.profile_concurrency is not None:
        passes += [(name, [args.profile_concurrency], True) for name in ("pdserve", "vllm")]
    with open(out / "servers.log", "wb") as log:
        for i, (name, levels, profile) in enumerate(passes):
            with Servers(log) as servers:
                url, roots = (start_vllm if name == "vllm" else start_pdserve)(model, servers, args)
                run_client(client_cmd(args, url, tokenizer, out / f"warmup_{i}", 2), out / f"warmup_{i}",
                           args.run_timeout)
                for c in levels:
                    tag = "profile" if profile else f"pass{i}"
                    row = measure(name, roots, args, url, tokenizer, out / f"{tag}_{name}_c{c}", c, profile)
                    row["pass"], row["profiled"] = i, profile
                    runs.append(row)
                    print(f"{name:8s} {tag:7s} c={c:<3d} {row['output_tokens_per_s'] or 0:8.1f} tok/s  ITL p50 "
                          f"{row['itl_p50_ms'] or 0:6.2f} ms  TTFT p50 {row['ttft_p50_ms'] or 0:8.1f} ms  CPU "
                          f"{row['cpu_s']}  errors {row['errors']:.0f}", flush=True)
    summary = ratios(runs, args.concurrency)
    report = {"client": args.client, "isl": args.isl, "osl": args.osl, "engine_flags": ENGINE_FLAGS,
              "max_num_seqs": args.max_num_seqs, "kv_cache_gib": args.kv_cache_gib, "order": ORDER,
              "machine_cpus": os.cpu_count(), "runs": runs, "summary": summary}
    (out / "frontend_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(summary, args)
    (out / "frontend_overhead.md").write_text(text)
    print("\n" + text + f"report: {out / 'frontend_overhead.json'}")
    return 0


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--client", choices=["aiperf", "pdserve"], default="aiperf",
                   help="the load generator: AIPerf (default; `make aiperf`) or pdserve bench profile")
    s.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf",
                   help="aiperf executable (default: .venv-aiperf/bin/aiperf, from `make aiperf`)")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32], help="levels (default: 1 16 32)")
    s.add_argument("--isl", type=int, default=200, help="prompt tokens (default: 200)")
    s.add_argument("--osl", type=int, default=64, help="output tokens, ignore_eos (default: 64)")
    s.add_argument("--requests", type=int, default=16, help="least requests per run (default: 16)")
    s.add_argument("--requests-per-client", type=int, default=4,
                   help="requests per concurrent client (default: 4; a run sends max(--requests, this x "
                        "concurrency))")
    s.add_argument("--max-num-seqs", type=int, default=64, help="engine batch limit (default: 64)")
    s.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache GiB (default: 2)")
    s.add_argument("--profile-concurrency", type=int, default=None,
                   help="py-spy the non-engine processes of each server's first pass at this concurrency")
    s.add_argument("--py-spy", default=str(Path(sys.executable).parent / "py-spy"),
                   help="py-spy executable (default: beside this Python; `make py-spy`)")
    s.add_argument("--run-timeout", type=float, default=900.0, help="seconds one client run may take (default: 900)")
    s.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    s.add_argument("--out", default="artifacts/frontend_overhead", help="output folder")


def add_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("frontend-overhead", help="pdserve aggregated vs vLLM's own OpenAI server, outside client, "
                                                   "CPU per request and py-spy profiles",
                        description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_arguments(s)


def run_cli(args: argparse.Namespace, prog: str = "pdserve bench frontend-overhead") -> int:
    try:
        return run(args)
    except PerfError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.frontend_overhead", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv), "bench.frontend_overhead")


if __name__ == "__main__":
    sys.exit(main())
