"""Frontend overhead: the same streaming requests through pdserve and through vLLM's own
OpenAI server, same model, same engine settings, measured in one run.

    python -m bench.frontend_overhead [--requests 24] [--concurrency 1 4] [--max-tokens 64]

Each server runs alone (its engine pinned to core 0), in the order vLLM, pdserve, pdserve,
vLLM, so a drift of this shared machine's speed over the run hits both sides alike. Per
server and concurrency it reports TTFT p50 and output tokens/s, then the pdserve/vLLM
ratios, and writes `frontend_overhead.json` in --out. The target: pdserve adds < 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.procs import free_port, stop_group, wait_ready

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
            "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_NO_USAGE_STATS": "1"}


def start_vllm(model: str, log) -> tuple[str, list[subprocess.Popen]]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--max-num-seqs", "32", "--disable-uvicorn-access-log"]
    p = subprocess.Popen(cmd, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/health", [p])
    return url, [p]


def start_pdserve(model: str, log) -> tuple[str, list[subprocess.Popen]]:
    wport, fport = free_port(), free_port()
    w = subprocess.Popen([sys.executable, "-m", "serve.cli", "worker", "--port", str(wport), "--model", model,
                          "--served-model-name", MODEL_NAME, "--cpu-cores", "0", "--kv-cache-gib", "1",
                          "--max-num-seqs", "32", "--log-level", "warning"],
                         env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{wport}/health", [w])
    f = subprocess.Popen([sys.executable, "-m", "serve.cli", "frontend", "--port", str(fport), "--model", model,
                          "--served-model-name", MODEL_NAME, "--worker", f"http://127.0.0.1:{wport}",
                          "--log-level", "warning"],
                         env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{fport}"
    wait_ready(f"{url}/health", [w, f])
    return url, [w, f]


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("choices") and data["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return ttft or float("nan"), tokens, time.perf_counter() - t0


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="artifacts/frontend_overhead")
    args = ap.parse_args()
    from serve.model import resolve_model

    model = resolve_model(None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"vllm": [], "pdserve": []}
    with open(out / "servers.log", "wb") as log:
        for name in ("vllm", "pdserve", "pdserve", "vllm"):
            url, procs = (start_vllm if name == "vllm" else start_pdserve)(model, log)
            try:
                for c in args.concurrency:
                    r = asyncio.run(measure(url, args.requests, c, args.max_tokens))
                    r["server"] = name
                    runs[name].append(r)
                    print(f"{name:8s} c={c:<3d} TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                          f"{r['output_tokens_per_s']:7.1f} tok/s", flush=True)
            finally:
                stop_group(procs)
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
