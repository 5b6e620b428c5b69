"""Talking to workers directly (their token-id protocol), for KV transfer tests."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serve.common import sse


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str | None
    kv_transfer: dict | None
    cached: int | None
    error: str | None


def generate(url: str, ids: list[int], max_tokens: int = 12, *, remote_decode: bool = False,
             kv_transfer: dict | None = None, request_id: str | None = None, timeout: float = 120) -> Result:
    body = {"request_id": request_id or uuid.uuid4().hex, "prompt_token_ids": ids,
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0}}
    if remote_decode:
        body["remote_decode"] = True
    if kv_transfer is not None:
        body["kv_transfer"] = kv_transfer
    tokens: list[int] = []
    last: dict = {}
    cached = None
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            last = json.loads(line)
            tokens += last.get("token_ids", [])
            if last.get("num_cached_tokens") is not None:
                cached = last["num_cached_tokens"]
    return Result(tokens, last.get("finish_reason"), last.get("kv_transfer"), cached, last.get("error"))


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))))
            out[key] = out.get(key, 0.0) + s.value
    return out


def metric(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    """`pred()`'s first true value, polled every `interval` for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def reset_prefix_cache(url: str, timeout: float = 30.0) -> None:
    """Empty a worker's prefix cache. vLLM refuses (`{"reset": false}`) while any block is in
    use: a request still finishing, or blocks held for a decode until it reads them or their
    lease ends; so ask until it is done."""
    def done() -> bool:
        r = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, (url, r.status_code, r.text)
        return r.json()["reset"] is True
    wait_for(done, timeout, f"{url}: prefix cache reset", interval=0.2)


def stream_in_background(url: str, body: dict, headers: dict | None = None, started_after: int = 1):
    """POST a streaming chat in a thread. Returns (thread, events, started): `events` collects
    every `data:` payload ("[DONE]" last), `started` is set once `started_after` arrived."""
    import threading

    events: list[str] = []
    started = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120,
                          headers=headers or {}) as r:
            for line in r.iter_lines():
                data = sse.payload(line)
                if data is not None:
                    events.append(data)
                    if len(events) >= started_after:
                        started.set()

    t = threading.Thread(target=run)
    t.start()
    return t, events, started
