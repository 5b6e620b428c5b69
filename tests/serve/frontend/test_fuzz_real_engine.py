"""The OpenAI-endpoint fuzz, a smoke run on a real vLLM engine behind the real frontend
(real engines found the seeded-sampling crash a simulated worker cannot have). The full
runs, on a simulated worker: test_fuzz_openai.py."""

from __future__ import annotations

import math

import httpx
import pytest
from hypothesis import given

from tests.helpers.fuzzbodies import SMOKE, chat_body, check, completion_body, encode, post
from tests.helpers.procs import MODEL

pytestmark = pytest.mark.engine


@SMOKE
@given(body=chat_body)
def test_fuzz_chat_smoke_on_a_real_engine(frontend, body):
    check(post(frontend, "/v1/chat/completions", encode(body)))


@SMOKE
@given(body=completion_body)
def test_fuzz_completion_smoke_on_a_real_engine(frontend, body):
    check(post(frontend, "/v1/completions", encode(body)))


def test_real_engine_still_serves_after_fuzzing(frontend):
    r = httpx.post(f"{frontend}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "temperature": 0, "max_tokens": 20,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    assert not math.isnan(r.json()["usage"]["total_tokens"])
