"""Property-based fuzzing of the OpenAI endpoints (hypothesis), the full runs: the real
frontend in front of a simulated worker. Whatever the body, the answer is never a 5xx,
every error is an OpenAI envelope, and the server keeps serving. (A smaller smoke run goes
to a real vLLM engine: test_fuzz_real_engine.py; real engines found the seeded-sampling
crash.)"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.fuzzbodies import FUZZ, chat_body, check, completion_body, encode, junk, post
from tests.helpers.procs import MODEL


@pytest.fixture(scope="module")
def sim_frontend(sim_agg) -> str:
    return sim_agg.url


@FUZZ
@given(body=chat_body)
def test_fuzz_chat_completions(sim_frontend, body):
    check(post(sim_frontend, "/v1/chat/completions", encode(body)))


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(sim_frontend, body):
    check(post(sim_frontend, "/v1/completions", encode(body)))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200) | junk.map(lambda v: json.dumps(v, allow_nan=True).encode()),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/route/explain"]))
def test_fuzz_raw_bodies(sim_frontend, raw, path):
    check(post(sim_frontend, path, raw))


def test_server_still_serves_after_fuzzing(sim_frontend):
    r = httpx.post(f"{sim_frontend}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "temperature": 0, "max_tokens": 20,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
