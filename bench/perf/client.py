"""A small streaming OpenAI chat client for pdserve's own benchmark scripts: timestamps at
line arrival (monotonic), the caller's connection pool, a timeout on every request. The
stream is read with serve.common.sse; an error event or a non-200 answer is a PerfError."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from bench.perf.errors import PerfError
from serve.common.sse import SseStream, text_of


@dataclass
class Timing:
    ttft_s: float
    latency_s: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                      ignore_eos: bool = True, timeout: float = 300.0) -> Timing:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks: list[float] = []
    text = []
    usage: dict = {}
    stream = SseStream()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise PerfError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            event = stream.feed(line)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                err = event["error"]
                raise PerfError(f"{url}: {err.get('message') if isinstance(err, dict) else err}")
            piece = text_of([event])
            if piece:
                chunks.append(now)
                text.append(piece)
            if event.get("usage"):
                usage = event["usage"]
    end = time.perf_counter()
    return Timing(ttft_s=(chunks[0] - t0) if chunks else end - t0, latency_s=end - t0, chunk_times=chunks,
                  prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", 0),
                  cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                  text="".join(text))


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
