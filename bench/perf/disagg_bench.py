"""Disaggregation benchmarks on this machine, each comparing two set-ups in one run.

    python -m bench.disagg_bench routing [OUT]  # kv vs round-robin routing, multi-turn prefix sharing
    python -m bench.disagg_bench mixed [OUT]    # decode ITL p99 under mixed long/short prompts, disagg vs agg

(`bench.disagg_bench` runs this module, bench.perf.disagg_bench; OUT defaults to
artifacts/disagg_bench, which gets routing.json or mixed.json and the servers' log.)

routing: 2 prefill workers (cores 0, 1) + 1 decode worker, two frontends on the same
workers (`--router-mode kv` and `round-robin`). Workload per frontend: SESSIONS sessions x
TURNS turns; each session starts with its own ~PREFIX_TOKENS-token system prompt and every
turn appends the previous answer (ANSWER_TOKENS tokens) and a new question, sessions
interleaved turn by turn, one request at a time. Prefix caches are reset between the two
runs. Reports cached-token ratio and TTFT p50 per mode, and kv/round-robin TTFT.

mixed: the same load against agg (2 aggregated workers, one per core) and disagg (1 prefill
on core 0, 1 decode on core 1): SHORT_STREAMS concurrent short-prompt streams of
SHORT_OUTPUT tokens while a long prompt (LONG_TOKENS) arrives every LONG_EVERY_S seconds.
Reports the short streams' inter-token latency p50/p99.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from bench.perf.client import percentile, stream_chat
from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, reset_prefix_cache, url_of

MODEL = "smollm2-135m-instruct"
# SESSIONS is odd so that round-robin over 2 prefill workers does not line up with sessions.
SESSIONS, TURNS, PREFIX_TOKENS, ANSWER_TOKENS = 7, 4, 1000, 24
SHORT_STREAMS, SHORT_OUTPUT, LONG_TOKENS, LONG_EVERY_S, MIXED_SECONDS = 4, 160, 2000, 2.0, 40


class Stack:
    """Workers and frontends of one set-up (pdserve processes, one log)."""

    def __init__(self, log: IO[bytes]) -> None:
        self.servers = Servers(log)

    def _serve(self, name: str, args: list[str], port: int) -> str:
        url = url_of(port)
        self.servers.serve(name, pdserve(*args), f"{url}/health")
        return url

    def worker(self, role: str, core: int, model: str) -> str:
        port = free_port()
        return self._serve(f"{role}@{port}", ["worker", "--role", role, "--port", str(port), "--model", model,
                                              "--served-model-name", MODEL, "--cpu-cores", str(core), "--kv-cache-gib",
                                              "1", "--max-num-seqs", "16", "--log-level", "warning"], port)

    def frontend(self, model: str, workers: list[str], extra: list[str]) -> str:
        port = free_port()
        args = ["frontend", "--port", str(port), "--model", model, "--served-model-name", MODEL,
                "--log-level", "warning", *extra]
        for w in workers:
            args += ["--worker", w]
        return self._serve(f"frontend@{port}", args, port)

    def stop(self) -> None:
        self.servers.stop()


def session_prefix(tag: str, s: int) -> str:
    return f"Session {tag}-{s}. " + " ".join(f"Note {s}.{j}: item {(s * 17 + j * 5) % 89} is on rack {j % 11}."
                                             for j in range(int(PREFIX_TOKENS / 15)))


async def multi_turn(url: str, tag: str) -> dict:
    ttfts, cached, prompt = [], 0, 0
    histories = [[{"role": "system", "content": session_prefix(tag, s)}] for s in range(SESSIONS)]
    async with httpx.AsyncClient() as client:
        for turn in range(TURNS):
            for s in range(SESSIONS):
                histories[s].append({"role": "user", "content": f"Question {turn}: where is item {turn * 3 + s}?"})
                t = await stream_chat(client, url, MODEL, histories[s], ANSWER_TOKENS)
                histories[s].append({"role": "assistant", "content": t.text})
                if turn > 0:  # the first turn cannot hit any cache in either mode
                    ttfts.append(t.ttft_s)
                    cached += t.cached_tokens
                    prompt += t.prompt_tokens
    return {"ttft_p50_ms": percentile(ttfts, 50) * 1000, "cached_token_ratio": cached / prompt if prompt else 0.0,
            "requests_measured": len(ttfts)}


def routing(out: Path) -> dict:
    from serve.model import resolve_model

    model = resolve_model(None)
    with open(out / "routing.log", "wb") as log:
        st = Stack(log)
        try:
            p0, p1 = st.worker("prefill", 0, model), st.worker("prefill", 1, model)
            d = st.worker("decode", 0, model)
            kv = st.frontend(model, [p0, p1, d], ["--router-mode", "kv"])
            rr = st.frontend(model, [p0, p1, d], ["--router-mode", "round-robin"])
            res = {}
            for name, url in (("kv", kv), ("round-robin", rr)):
                for w in (p0, p1, d):
                    reset_prefix_cache(w)
                res[name] = asyncio.run(multi_turn(url, name))
                print(f"{name:12s} TTFT p50 {res[name]['ttft_p50_ms']:7.1f} ms, cached-token ratio "
                      f"{res[name]['cached_token_ratio']:.3f}", flush=True)
        finally:
            st.stop()
    res["kv_over_round_robin_ttft_p50"] = res["kv"]["ttft_p50_ms"] / res["round-robin"]["ttft_p50_ms"]
    res["workload"] = {"sessions": SESSIONS, "turns": TURNS, "prefix_tokens": PREFIX_TOKENS,
                       "answer_tokens": ANSWER_TOKENS, "prefill_workers": 2, "decode_workers": 1}
    print(f"kv / round-robin TTFT p50 = {res['kv_over_round_robin_ttft_p50']:.3f}")
    return res


async def mixed_load(url: str) -> dict:
    itls: list[float] = []
    long_ttfts: list[float] = []
    stop_at = time.perf_counter() + MIXED_SECONDS
    long_text = " ".join(f"Entry {i}: the value is {i * 7 % 113}." for i in range(int(LONG_TOKENS / 11)))
    async with httpx.AsyncClient() as client:
        async def short_stream(k: int) -> None:
            n = 0
            while time.perf_counter() < stop_at:
                t = await stream_chat(client, url, MODEL, [{"role": "user", "content": f"Tell story {k}-{n}."}],
                                      SHORT_OUTPUT)
                itls.extend(t.itls())
                n += 1

        async def long_arrivals() -> None:
            n = 0
            while time.perf_counter() < stop_at:
                t = await stream_chat(client, url, MODEL, [{"role": "user", "content": f"{n} {long_text}"}], 4)
                long_ttfts.append(t.ttft_s)
                n += 1
                await asyncio.sleep(LONG_EVERY_S)

        await asyncio.gather(*(short_stream(k) for k in range(SHORT_STREAMS)), long_arrivals())
    return {"itl_p50_ms": percentile(itls, 50) * 1000, "itl_p99_ms": percentile(itls, 99) * 1000,
            "long_ttft_p50_ms": percentile(long_ttfts, 50) * 1000, "long_requests": len(long_ttfts),
            "itl_samples": len(itls)}


def mixed(out: Path) -> dict:
    from serve.model import resolve_model

    model = resolve_model(None)
    res = {}
    with open(out / "mixed.log", "wb") as log:
        for name, roles in (("agg", [("agg", 0), ("agg", 1)]), ("disagg", [("prefill", 0), ("decode", 1)])):
            st = Stack(log)
            try:
                workers = [st.worker(role, core, model) for role, core in roles]
                url = st.frontend(model, workers, [])
                res[name] = asyncio.run(mixed_load(url))
                print(f"{name:7s} short-stream ITL p50 {res[name]['itl_p50_ms']:6.1f} ms, p99 "
                      f"{res[name]['itl_p99_ms']:6.1f} ms; long-prompt TTFT p50 {res[name]['long_ttft_p50_ms']:.0f} ms",
                      flush=True)
            finally:
                st.stop()
    res["disagg_over_agg_itl_p99"] = res["disagg"]["itl_p99_ms"] / res["agg"]["itl_p99_ms"]
    res["load"] = {"short_streams": SHORT_STREAMS, "short_output_tokens": SHORT_OUTPUT,
                   "long_prompt_tokens": LONG_TOKENS, "long_every_s": LONG_EVERY_S, "seconds": MIXED_SECONDS}
    print(f"disagg / agg ITL p99 = {res['disagg_over_agg_itl_p99']:.3f}")
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    which = argv[0] if argv else "routing"
    if which not in ("routing", "mixed"):
        print("usage: python -m bench.disagg_bench routing|mixed [OUT]", file=sys.stderr)
        return 2
    out = Path(argv[1] if len(argv) > 1 else "artifacts/disagg_bench")
    out.mkdir(parents=True, exist_ok=True)
    try:
        res = routing(out) if which == "routing" else mixed(out)
    except PerfError as e:
        print(f"bench.disagg_bench {which}: error: {e}", file=sys.stderr)
        return 2
    (out / f"{which}.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
