"""`pdserve bench kv --e2e`: the same prompts through (a) pdserve's connector and (b) vLLM's
NixlConnector (the reference), in bf16 and fp8, prefill engine on core 0 and decode engine
on core 1, one pair at a time.

Per request: the decode side's TTFT as the client sees it (request sent to the decode
engine -> first token; it contains the whole KV wait: handshake, acquire, READ, scheduling,
plus one token of compute that is the same for both), the bytes moved and, for pdserve, the
connector's own READ time. Writes `bench_kv_e2e.json` and prints a table with the ratios
the targets name: decode-side KV wait pdserve / NixlConnector, fp8 / bf16 transfer time,
and pdserve's achieved GB/s / raw NIXL READ at the same descriptor size (measured here).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, url_of
from serve.common.sse import SseStream
from serve.cpu_attention import DEFAULT as CPU_ATTN_DEFAULT, ENV as CPU_ATTN_ENV

MODEL_NAME = "smollm2-135m-instruct"
LENGTHS = [300, 520, 777, 1000, 1200, 1500, 1777, 1999, 2400, 3000]


def metric_sum(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


def env_for(core: int) -> dict[str, str]:
    return {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": str(core), "UCX_NET_DEVICES": "lo",
            # the same attention kernel as pdserve's workers (serve.cpu_attention), vLLM's server too
            CPU_ATTN_ENV: os.environ.get(CPU_ATTN_ENV, CPU_ATTN_DEFAULT)}


def pdserve_pair(model: str, kv: list[str], servers: Servers) -> tuple[str, str]:
    """A pdserve prefill worker (core 0) and decode worker (core 1), ready: their URLs."""
    started = []
    for role, core in (("prefill", 0), ("decode", 1)):
        port = free_port()
        cmd = pdserve("worker", "--role", role, "--port", str(port), "--model", model, "--served-model-name",
                      MODEL_NAME, "--cpu-cores", str(core), "--kv-cache-gib", "2", "--max-num-seqs", "4",
                      "--max-model-len", "4096", "--log-level", "warning", *kv)
        started.append((servers.start(f"pdserve {role}", cmd, env_for(core)), url_of(port)))
    for child, url in started:
        servers.ready(child, f"{url}/health")
    return started[0][1], started[1][1]


def nixl_pair(model: str, kv: list[str], servers: Servers) -> tuple[str, str]:
    """Two vLLM OpenAI servers with NixlConnector (cores 0 and 1), ready: their URLs."""
    started = []
    for core in (0, 1):
        port = free_port()
        cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--max-num-seqs", "4", "--max-model-len", "4096", "--kv-transfer-config", cfg,
               "--disable-uvicorn-access-log", *kv]
        env = {**env_for(core), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        started.append((servers.start(f"vllm nixl core {core}", cmd, env), url_of(port)))
    for child, url in started:
        servers.ready(child, f"{url}/health")
    return started[0][1], started[1][1]


def pdserve_request(purl: str, durl: str, ids: list[int]) -> float:
    rid = uuid.uuid4().hex
    body = {"request_id": rid, "prompt_token_ids": ids, "remote_decode": True,
            "sampling": {"max_tokens": 1, "temperature": 0.0}}
    params = None
    with httpx.stream("POST", f"{purl}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                params = json.loads(line).get("kv_transfer") or params
    body = {"request_id": rid + "-d", "prompt_token_ids": ids, "kv_transfer": params,
            "sampling": {"max_tokens": 2, "temperature": 0.0}}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{durl}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():  # the worker's /generate streams JSON lines, not SSE
            if line and json.loads(line).get("token_ids"):
                return time.perf_counter() - t0
    raise PerfError("no token from the pdserve decode worker")


def nixl_request(purl: str, durl: str, ids: list[int]) -> float:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    params = httpx.post(f"{purl}/v1/completions", json=body, timeout=120).json()["kv_transfer_params"]
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True,
            "kv_transfer_params": params}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{durl}/v1/completions", json=body, timeout=120) as r:
        for event in SseStream().parse(r.iter_lines()):
            if (event.get("choices") or [{}])[0].get("text") is not None:
                return time.perf_counter() - t0
    raise PerfError("no token from the vLLM decode server")


def prompt_ids(tokenizer, n: int, salt: int) -> list[int]:
    text = "\n".join(f"Record {salt}-{i}: sensor {i % 13} read {(i * 37 + salt) % 997} units." for i in range(600))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise PerfError(f"the prompt text has {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


def run(out_dir: str, repeats: int = 1, impls: tuple[str, ...] = ("pdserve", "nixl"),
        kinds: tuple[str, ...] = ("bf16", "fp8")) -> dict:
    from serve.frontend.tokenizer import Tokenizer
    from serve.model import resolve_model

    model = resolve_model(None)
    tok = Tokenizer(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"lengths": LENGTHS, "runs": {}}
    with open(out / "bench_kv_e2e.log", "wb") as log:
        for kind, kv in (("bf16", []), ("fp8", ["--kv-cache-dtype", "fp8"])):
            if kind not in kinds:
                continue
            for impl, start, request, bytes_metric in (
                    ("pdserve", pdserve_pair, pdserve_request, "pdserve_kv_bytes_transferred_total"),
                    ("nixl", nixl_pair, nixl_request, "vllm:nixl_bytes_transferred_sum")):
                if impl not in impls:
                    continue
                servers = Servers(log)
                try:
                    purl, durl = start(model, kv, servers)
                    for w in range(2):  # warm-up (handshake happens here)
                        request(purl, durl, prompt_ids(tok, 400, 10_000 + w))
                    b0 = metric_sum(durl, bytes_metric)
                    t0 = metric_sum(durl, "pdserve_kv_transfer_duration_seconds_sum") if impl == "pdserve" else 0.0
                    ttfts = []
                    for rep in range(repeats):
                        for i, n in enumerate(LENGTHS):
                            ttfts.append(request(purl, durl, prompt_ids(tok, n, rep * 100 + i)))
                    moved = metric_sum(durl, bytes_metric) - b0
                    row = {"decode_ttft_ms": [t * 1000 for t in ttfts], "bytes_moved": moved,
                           "decode_ttft_p50_ms": statistics.median(ttfts) * 1000}
                    if impl == "pdserve":
                        secs = metric_sum(durl, "pdserve_kv_transfer_duration_seconds_sum") - t0
                        row["transfer_seconds"] = secs
                        row["achieved_gbps"] = moved / secs / 1e9 if secs else 0.0
                    results["runs"][f"{impl}-{kind}"] = row
                    print(f"{impl:8s} {kind}: decode TTFT p50 {row['decode_ttft_p50_ms']:7.1f} ms, "
                          f"{moved / 2**20:8.1f} MiB moved"
                          + (f", READ {row['transfer_seconds'] * 1000:.1f} ms in all, "
                             f"{row['achieved_gbps']:.2f} GB/s" if impl == "pdserve" else ""), flush=True)
                finally:
                    servers.stop()
    r = results["runs"]
    summary: dict[str, float] = {}
    for kind in kinds:
        if f"pdserve-{kind}" in r and f"nixl-{kind}" in r:
            summary[f"kv_wait_ratio_{kind}"] = r[f"pdserve-{kind}"]["decode_ttft_p50_ms"] / r[f"nixl-{kind}"]["decode_ttft_p50_ms"]
    if "pdserve-fp8" in r and "pdserve-bf16" in r:
        summary["fp8_over_bf16_transfer_time"] = r["pdserve-fp8"]["transfer_seconds"] / r["pdserve-bf16"]["transfer_seconds"]
        summary["fp8_over_bf16_bytes"] = r["pdserve-fp8"]["bytes_moved"] / r["pdserve-bf16"]["bytes_moved"]
    # Raw NIXL READ at the connector's descriptor size: one descriptor per layer per request,
    # (blocks x per-layer block bytes) long; the median request here reads ~8 blocks x 96 KiB.
    from bench.perf.kv.micro import raw_read_gbps

    desc = 8 * 96 * 1024
    raw = raw_read_gbps(desc, 128)
    summary["raw_nixl_read_gbps_at_descriptor"] = raw
    summary["descriptor_bytes"] = desc
    first = next((r[f"pdserve-{k}"] for k in kinds if f"pdserve-{k}" in r), None)
    if first is not None:
        summary["connector_over_raw_read"] = first["achieved_gbps"] / raw
    results["summary"] = summary
    (out / "bench_kv_e2e.json").write_text(json.dumps(results, indent=2))
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    return results
