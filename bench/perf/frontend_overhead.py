"""Frontend overhead: the same streaming requests through pdserve and through vLLM's own
OpenAI server, same model, same engine settings, measured in one run.

    python -m bench.frontend_overhead [--requests 24] [--concurrency 1 4] [--max-tokens 64]

(`bench.frontend_overhead` runs this module, bench.perf.frontend_overhead.)

Each server runs alone (its engine pinned to core 0), in the order vLLM, pdserve, pdserve,
vLLM, so a drift of this shared machine's speed over the run hits both sides alike. Per
server and concurrency it reports TTFT p50 and output tokens/s, then the pdserve/vLLM
ratios, and writes `frontend_overhead.json` in --out. The target: pdserve adds < 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.perf.client import stream_chat
from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, url_of
from serve.cpu_attention import DEFAULT as CPU_ATTN_DEFAULT, ENV as CPU_ATTN_ENV

MODEL_NAME = "smollm2-135m-instruct"
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a bicycle works in simple terms.",
    "List five fruits and their colors.",
    "What is the difference between a cat and a dog?",
    "Describe the water cycle.",
]


def cpu_env() -> dict[str, str]:
    return {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_NO_USAGE_STATS": "1",
            # the same attention kernel as pdserve's workers (serve.cpu_attention), vLLM's server too
            CPU_ATTN_ENV: os.environ.get(CPU_ATTN_ENV, CPU_ATTN_DEFAULT)}


def start_vllm(model: str, servers: Servers) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--max-num-seqs", "32", "--disable-uvicorn-access-log"]
    url = url_of(port)
    servers.serve("vllm", cmd, f"{url}/health", env=cpu_env())
    return url


def start_pdserve(model: str, servers: Servers) -> str:
    wport, fport = free_port(), free_port()
    worker = url_of(wport)
    servers.serve("pdserve worker", pdserve("worker", "--port", str(wport), "--model", model, "--served-model-name",
                                            MODEL_NAME, "--cpu-cores", "0", "--kv-cache-gib", "1", "--max-num-seqs",
                                            "32", "--log-level", "warning"), f"{worker}/health", env=cpu_env())
    url = url_of(fport)
    servers.serve("pdserve frontend", pdserve("frontend", "--port", str(fport), "--model", model, "--served-model-name",
                                              MODEL_NAME, "--worker", worker, "--log-level", "warning"),
                  f"{url}/health", env=cpu_env())
    return url


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    """(TTFT s, output tokens, latency s) of one streaming chat request (TTFT nan without content)."""
    t = await stream_chat(client, url, MODEL_NAME, [{"role": "user", "content": prompt}], max_tokens, timeout=120.0)
    return (t.ttft_s if t.chunk_times else math.nan), t.completion_tokens, t.latency_s


async def measure(url: str, n: int, concurrency: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for p in PROMPTS[:2]:  # warm-up
            await one(client, url, p, 8)
        sem = asyncio.Semaphore(concurrency)

        async def guarded(i: int):
            async with sem:
                return await one(client, url, PROMPTS[i % len(PROMPTS)], max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(i) for i in range(n)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {"ttft_p50_ms": statistics.median(ttfts) * 1000, "output_tokens_per_s": tokens / wall,
            "requests": n, "concurrency": concurrency, "output_tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.frontend_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="artifacts/frontend_overhead")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except PerfError as e:
        print(f"bench.frontend_overhead: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from serve.model import resolve_model

    model = resolve_model(None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"vllm": [], "pdserve": []}
    with open(out / "servers.log", "wb") as log:
        for name in ("vllm", "pdserve", "pdserve", "vllm"):
            servers = Servers(log)
            try:
                url = (start_vllm if name == "vllm" else start_pdserve)(model, servers)
                for c in args.concurrency:
                    r = asyncio.run(measure(url, args.requests, c, args.max_tokens))
                    r["server"] = name
                    runs[name].append(r)
                    print(f"{name:8s} c={c:<3d} TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                          f"{r['output_tokens_per_s']:7.1f} tok/s", flush=True)
            finally:
                servers.stop()
    summary = []
    for c in args.concurrency:
        v = [r for r in runs["vllm"] if r["concurrency"] == c]
        p = [r for r in runs["pdserve"] if r["concurrency"] == c]
        ttft_v = statistics.mean(r["ttft_p50_ms"] for r in v)
        ttft_p = statistics.mean(r["ttft_p50_ms"] for r in p)
        tps_v = statistics.mean(r["output_tokens_per_s"] for r in v)
        tps_p = statistics.mean(r["output_tokens_per_s"] for r in p)
        row = {"concurrency": c, "vllm_ttft_p50_ms": ttft_v, "pdserve_ttft_p50_ms": ttft_p,
               "ttft_ratio": ttft_p / ttft_v, "vllm_tokens_per_s": tps_v, "pdserve_tokens_per_s": tps_p,
               "throughput_ratio": tps_p / tps_v}
        summary.append(row)
        print(f"c={c}: TTFT p50 pdserve/vLLM = {row['ttft_ratio']:.3f}, "
              f"output tok/s pdserve/vLLM = {row['throughput_ratio']:.3f}")
    (out / "frontend_overhead.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
