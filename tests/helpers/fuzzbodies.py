"""What the OpenAI-endpoint fuzz tests share (hypothesis): body strategies and the check
that an answer is never a 5xx, every error is an OpenAI envelope and every stream ends.
Generated bodies always carry a tiny output budget, so the valid ones cost a few engine
steps. Used by tests/serve/frontend/test_fuzz_openai.py (simulated worker, full runs) and
test_fuzz_real_engine.py (a real vLLM engine, a smoke run)."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

from serve.common import sse
from tests.helpers.procs import MODEL

FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SMOKE = settings(max_examples=20, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

junk = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                    | st.text(max_size=20), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=6)


def mostly(valid: st.SearchStrategy, bad: st.SearchStrategy = junk) -> st.SearchStrategy:
    """Valid values six times in seven: a good share of whole bodies is valid, so the deep
    paths (engine, streaming, stop strings, detokenizing) get fuzzed, not only the validator."""
    return st.integers(0, 6).flatmap(lambda i: valid if i else bad)


small_int = st.integers(-3, 4)
text = st.text(max_size=60)
content = mostly(text | st.lists(st.fixed_dictionaries({"type": mostly(st.just("text"), st.sampled_from(["image_url", "x"])),
                                                        "text": text}), max_size=3))
message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "developer", "user", "assistant"]),
                                                st.sampled_from(["tool", "x"]) | junk),
                                 "content": content})
common = {
    "model": mostly(st.just(MODEL), st.sampled_from(["other-model", ""]) | junk),
    # never None: a chat request without a limit may generate up to the whole context (valid, and slow)
    "max_tokens": mostly(st.integers(1, 4), small_int | st.integers(10**5, 2**70) | junk.filter(lambda v: v is not None)),
}
optional = {
    "temperature": mostly(st.floats(0, 2), st.floats(-1, 3, allow_nan=False) | junk),
    "top_p": mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5, allow_nan=False) | junk),
    "seed": mostly(st.integers(0, 2**31), st.integers(-2**64, 2**64) | junk),
    "stop": mostly(text | st.lists(text, max_size=4), st.lists(text, min_size=5, max_size=8) | junk),
    "n": mostly(st.just(1), small_int | junk),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": mostly(st.booleans()),
    "min_tokens": mostly(st.integers(0, 4), st.integers(0, 10**6) | junk),
    "logprobs": mostly(st.just(False), st.booleans() | junk),
    "presence_penalty": mostly(st.floats(-2, 2, allow_nan=False), junk),
    "user": mostly(text),
    "extra_field": junk,
}
chat_body = st.fixed_dictionaries({**common, "messages": mostly(st.lists(message, min_size=1, max_size=4),
                                                                st.lists(message, max_size=0) | junk)},
                                  optional=optional)
prompt = mostly(text | st.lists(st.integers(0, 40000), min_size=1, max_size=8),
                st.lists(st.integers(-5, 60000), max_size=8) | st.lists(text, max_size=2) | junk)
completion_body = st.fixed_dictionaries({**common, "prompt": prompt}, optional=optional)


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN/Infinity: not JSON, must be a 400


def check(resp: httpx.Response) -> None:
    event(f"HTTP {resp.status_code}")  # pytest --hypothesis-show-statistics: how many were served
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        stream = sse.SseStream()
        # a failure after the stream started is an error event, never a 5xx
        for ev in stream.parse(resp.text.splitlines()):
            if "error" in ev:
                assert ev["error"]["message"]
        assert stream.done
    else:
        assert resp.json()["choices"]


def post(frontend: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{frontend}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)


