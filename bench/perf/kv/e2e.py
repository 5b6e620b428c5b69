"""`pdserve bench kv --e2e`: the same prompt lengths through pdserve's connector in push and
in pull mode (one pair of engines, requests alternating between the modes) and through vLLM's
NixlConnector (the reference), in bf16 and fp8, prefill engine on core 0 and decode engine
on core 1, one pair at a time.

Per request: the decode side's TTFT as the client sees it (request sent to the decode
engine -> first token; it contains the whole KV wait: handshake, acquire or push, transfer,
scheduling, plus one token of compute that is the same for all). `--repeats` passes (default
5); per pass the p50, over passes min / median / max / spread. Bytes moved per mode from the
workers' metrics (pushed bytes on the prefill side, the rest pulled). Writes
`bench_kv_e2e.json` and prints the ratios the targets name (`summarize`).
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


def pdserve_request(purl: str, durl: str, ids: list[int], mode: str | None = None) -> tuple[float, float]:
    """One prompt prefilled on `purl`, then its first token from `durl`: the decode side's TTFT
    and its KV wait (the worker's `kv_load_s`: queued to first scheduled in the engine, vLLM's
    own request timestamps). `mode` asks the decode engine for push or pull for this request
    (GenerateRequest.kv_transfer_mode); None: its own."""
    rid = uuid.uuid4().hex
    body = {"request_id": rid, "prompt_token_ids": ids, "remote_decode": True,
            "sampling": {"max_tokens": 1, "temperature": 0.0}}
    params = None
    with httpx.stream("POST", f"{purl}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                params = json.loads(line).get("kv_transfer") or params
    if params is None:
        raise PerfError("the pdserve prefill worker returned no kv_transfer params")
    body = {"request_id": rid + "-d", "prompt_token_ids": ids, "kv_transfer": params,
            "sampling": {"max_tokens": 2, "temperature": 0.0}}
    if mode is not None:
        body["kv_transfer_mode"] = mode
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{durl}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():  # the worker's /generate streams JSON lines, not SSE
            delta = json.loads(line) if line else {}
            if delta.get("token_ids"):
                if delta.get("kv_load_s") is None:
                    raise PerfError("the decode worker reported no kv_load_s")
                return time.perf_counter() - t0, float(delta["kv_load_s"])
    raise PerfError("no token from the pdserve decode worker")


def nixl_request(purl: str, durl: str, ids: list[int]) -> float:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    params = httpx.post(f"{purl}/v1/completions", json=body, timeout=120).json()["kv_transfer_params"]
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True,
            "kv_transfer_params": params}
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{durl}/v1/completions", json=body, timeout=120) as r:
        for event in SseStream().parse(r.iter_lines()):  # read to the end: the request then finishes, not
            if ttft is None and (event.get("choices") or [{}])[0].get("text") is not None:  # aborts, and is
                ttft = time.perf_counter() - t0  # counted in vLLM's queue-time histogram
    if ttft is None:
        raise PerfError("no token from the vLLM decode server")
    return ttft


def prompt_ids(tokenizer, n: int, salt: int) -> list[int]:
    text = "\n".join(f"Record {salt}-{i}: sensor {i % 13} read {(i * 37 + salt) % 997} units." for i in range(600))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise PerfError(f"the prompt text has {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "spread": max(values) - min(values)}


def _pdserve_runs(purl: str, durl: str, tok, modes: list[str], repeats: int) -> dict[str, list[list[tuple]]]:
    """Per mode, per repeat, (decode TTFT, KV wait) in s of LENGTHS; the modes alternate request
    by request (order flipped every other prompt) on the same pair of engines, each on its own
    prompts (no prefix-cache hits across modes)."""
    out: dict[str, list[list[tuple]]] = {m: [] for m in modes}
    for rep in range(repeats):
        for m in modes:
            out[m].append([])
        for i, n in enumerate(LENGTHS):
            order = modes if i % 2 == 0 else modes[::-1]
            for m in order:
                salt = rep * 1000 + i * 10 + modes.index(m)
                out[m][rep].append(pdserve_request(purl, durl, prompt_ids(tok, n, salt), None if m == "pdserve" else m))
    return out


def _row(reps: list[list[tuple]], nbytes: float | None) -> dict:
    """One mode's runs: per repeat the decode TTFT p50, the KV wait mean, and (where each
    request's is known: pdserve) the KV wait p50; over repeats their spreads."""
    ttft = [[t for t, _ in r if t != "mean"] for r in reps]
    waits = [[w for t, w in r if t != "mean" and w is not None] for r in reps]
    means = [next((w for t, w in r if t == "mean"), None) for r in reps]
    mean_ms = [(m if m is not None else statistics.fmean(w)) * 1000 for m, w in zip(means, waits)]
    p50s = [statistics.median(t) * 1000 for t in ttft]
    wait_p50 = [statistics.median(w) * 1000 for w in waits if w]
    return {"decode_ttft_ms": [[t * 1000 for t in r] for r in ttft], "kv_wait_ms": [[w * 1000 for w in r] for r in waits],
            "p50_ms_by_repeat": p50s, "p50_ms": spread(p50s),
            "kv_wait_mean_ms_by_repeat": mean_ms, "kv_wait_mean_ms": spread(mean_ms),
            "kv_wait_p50_ms_by_repeat": wait_p50, "kv_wait_p50_ms": spread(wait_p50) if wait_p50 else None,
            "bytes_moved": nbytes}


def run(out_dir: str, repeats: int = 5, impls: tuple[str, ...] = ("push", "pull", "nixl"),
        kinds: tuple[str, ...] = ("bf16", "fp8")) -> dict:
    """`impls`: push and pull (pdserve's connector, one pair of engines, requests alternating),
    pdserve (the same pair, the engine's own mode: auto), nixl (vLLM's NixlConnector). Each
    repeat is one pass over LENGTHS; per repeat the decode TTFT p50 (the KV wait plus one
    token), and over repeats its min / median / max / spread."""
    from serve.frontend.tokenizer import Tokenizer
    from serve.model import resolve_model

    model = resolve_model(None)
    tok = Tokenizer(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in ("push", "pull", "pdserve") if m in impls]
    results: dict = {"lengths": LENGTHS, "repeats": repeats, "runs": {}}
    with open(out / "bench_kv_e2e.log", "wb") as log:
        for kind, kv in (("bf16", []), ("fp8", ["--kv-cache-dtype", "fp8"])):
            if kind not in kinds:
                continue
            for impl in (["pdserve"] if modes else []) + (["nixl"] if "nixl" in impls else []):
                servers = Servers(log)
                try:
                    if impl == "pdserve":
                        purl, durl = pdserve_pair(model, kv, servers)
                        for w, m in enumerate(modes * 2):  # warm-up: the handshake happens here
                            pdserve_request(purl, durl, prompt_ids(tok, 400, 10_000 + w), None if m == "pdserve" else m)
                        time.sleep(2)  # the warm-up's stats reach the metrics
                        b0 = metric_sum(durl, "pdserve_kv_bytes_transferred_total")
                        p0 = metric_sum(purl, "pdserve_kv_bytes_pushed_total")
                        runs = _pdserve_runs(purl, durl, tok, modes, repeats)
                        time.sleep(2)
                        moved = metric_sum(durl, "pdserve_kv_bytes_transferred_total") - b0
                        pushed = metric_sum(purl, "pdserve_kv_bytes_pushed_total") - p0
                        recomputes = metric_sum(durl, "pdserve_kv_recomputes_total")
                        by_mode = {"push": pushed, "pull": moved - pushed} if "pdserve" not in modes else {}
                    else:
                        purl, durl = nixl_pair(model, kv, servers)
                        for w in range(2):
                            nixl_request(purl, durl, prompt_ids(tok, 400, 10_000 + w))
                        time.sleep(2)
                        b0 = metric_sum(durl, "vllm:nixl_bytes_transferred_sum")
                        reps = []
                        for rep in range(repeats):
                            q0 = (metric_sum(durl, "vllm:request_queue_time_seconds_sum"),
                                  metric_sum(durl, "vllm:request_queue_time_seconds_count"))
                            ttfts = [nixl_request(purl, durl, prompt_ids(tok, n, rep * 1000 + i * 10 + 7))
                                     for i, n in enumerate(LENGTHS)]
                            time.sleep(1.5)  # the last requests' stats reach the metrics
                            waited = metric_sum(durl, "vllm:request_queue_time_seconds_sum") - q0[0]
                            count = metric_sum(durl, "vllm:request_queue_time_seconds_count") - q0[1]
                            reps.append([(t, None) for t in ttfts] + [("mean", waited / max(count, 1))])
                        runs = {"nixl": reps}
                        by_mode = {"nixl": metric_sum(durl, "vllm:nixl_bytes_transferred_sum") - b0}
                        recomputes = 0.0
                    for m, reps in runs.items():
                        results["runs"][f"{m}-{kind}"] = row = _row(reps, by_mode.get(m))
                        if impl == "pdserve":
                            row["recomputes_on_pair"] = recomputes
                        print(f"{m:8s} {kind}: KV wait mean by repeat "
                              + " ".join(f"{v:6.1f}" for v in row["kv_wait_mean_ms_by_repeat"]) + " ms"
                              + ("; p50 " + " ".join(f"{v:6.1f}" for v in row["kv_wait_p50_ms_by_repeat"])
                                 if row["kv_wait_p50_ms_by_repeat"] else "")
                              + "; decode TTFT p50 " + " ".join(f"{v:6.1f}" for v in row["p50_ms_by_repeat"])
                              + (f"; {row['bytes_moved'] / 2**20:.1f} MiB moved" if row["bytes_moved"] else ""),
                              flush=True)
                finally:
                    servers.stop()
    results["summary"] = summarize(results["runs"], kinds)
    (out / "bench_kv_e2e.json").write_text(json.dumps(results, indent=2))
    for k, v in results["summary"].items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    return results


def summarize(r: dict, kinds: tuple[str, ...]) -> dict:
    """The issue's targets from the runs: per dtype, push vs pull per repeat (push at least as
    fast on every repeat, push's spread at most half of pull's), push / NixlConnector per
    repeat (<= 1.0 in every one), and fp8 / bf16 bytes per mode (half)."""
    summary: dict = {}
    for kind in kinds:
        push, pull, nixl = (r.get(f"{m}-{kind}") for m in ("push", "pull", "nixl"))
        if push and pull:  # the decode-side KV wait p50 per repeat (same pair, alternating requests)
            a, b = push["kv_wait_p50_ms_by_repeat"], pull["kv_wait_p50_ms_by_repeat"]
            summary[f"push_le_pull_every_repeat_{kind}"] = all(x <= y for x, y in zip(a, b))
            summary[f"push_over_pull_p50_{kind}"] = push["kv_wait_p50_ms"]["median"] / pull["kv_wait_p50_ms"]["median"]
            if pull["kv_wait_p50_ms"]["spread"] > 0:
                summary[f"push_spread_over_pull_spread_{kind}"] = (push["kv_wait_p50_ms"]["spread"]
                                                                   / pull["kv_wait_p50_ms"]["spread"])
        for m, row in (("push", push), ("pull", pull), ("pdserve", r.get(f"pdserve-{kind}"))):
            if row and nixl:  # means: vLLM's server reports its queue time only as a histogram
                ratios = [x / y for x, y in zip(row["kv_wait_mean_ms_by_repeat"], nixl["kv_wait_mean_ms_by_repeat"])]
                summary[f"{m}_over_nixl_max_{kind}"] = max(ratios)
                summary[f"{m}_over_nixl_median_{kind}"] = statistics.median(ratios)
    for m in ("push", "pull", "nixl"):
        a, b = r.get(f"{m}-fp8"), r.get(f"{m}-bf16")
        if a and b and a.get("bytes_moved") and b.get("bytes_moved"):
            summary[f"fp8_over_bf16_bytes_{m}"] = a["bytes_moved"] / b["bytes_moved"]
    return summary
