"""The OpenAI endpoints end to end over real HTTP, against a simulated worker: streaming
and unary agree, sampling options, stop strings, prefix-cache usage, the OpenAI client,
error envelopes, metrics and client disconnects. (What only a real engine can show, real
text and the CPU seed crash, is in test_frontend_e2e.py.)"""

from __future__ import annotations


import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.common import sse
from tests.helpers.openai import aborted_count, assert_envelope, metric_value, wait_idle
from tests.conftest import MODEL

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PROMPTS = [
    FRANCE,
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
]


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


def stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        s = sse.SseStream()
        events = list(s.parse(resp.iter_lines()))
        assert s.done
        return events


def chat_text(events: list[dict]) -> str:
    return sse.text_of(e for e in events if e.get("choices"))


@pytest.mark.parametrize("messages", CHAT_PROMPTS)
def test_chat_stream_joins_to_non_stream(sim_agg, messages):
    url = sim_agg.url
    req = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 48,
           "stream_options": {"include_usage": True}}
    r = post(url, "/v1/chat/completions", req)
    full = r.json()
    assert full["object"] == "chat.completion" and r.headers["x-request-id"] == full["id"]
    u = full["usage"]
    assert u["prompt_tokens"] > 0 and 0 < u["completion_tokens"] <= 48
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    events = stream(url, "/v1/chat/completions", req)
    chunks = [e for e in events if e.get("choices")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_text(events) == full["choices"][0]["message"]["content"] != ""
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == u["completion_tokens"]
    assert all(e["object"] == "chat.completion.chunk" and "usage" in e for e in events)


def test_completion_stream_joins_to_non_stream_and_accepts_token_ids(sim_agg, tokenizer):
    url = sim_agg.url
    req = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 40}
    full = post(url, "/v1/completions", req).json()
    assert full["object"] == "text_completion"
    events = stream(url, "/v1/completions", req)
    assert "".join(e["choices"][0]["text"] for e in events) == full["choices"][0]["text"]
    assert all("usage" not in e for e in events)  # no include_usage: no usage field at all
    ids = tokenizer.encode("The capital of France is", add_special_tokens=True)
    by_ids = post(url, "/v1/completions", {**req, "prompt": ids}).json()
    assert by_ids["choices"][0]["text"] == full["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert post(url, "/v1/completions", {**req, "prompt": [ids]}).json()["choices"] == by_ids["choices"]


def test_ignore_eos_min_tokens_and_length(sim_agg):
    url = sim_agg.url
    base = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 300}
    r = post(url, "/v1/chat/completions", {**base, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 300 and r["choices"][0]["finish_reason"] == "length"
    free = post(url, "/v1/chat/completions", base).json()
    assert free["choices"][0]["finish_reason"] == "stop" and free["usage"]["completion_tokens"] < 300  # an EOS
    r = post(url, "/v1/chat/completions", {**base, "min_tokens": 250}).json()
    assert r["usage"]["completion_tokens"] >= 250


def test_stop_string_truncates_unary_and_streaming(sim_agg):
    url = sim_agg.url
    base = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 30, "ignore_eos": True}
    full = post(url, "/v1/chat/completions", base).json()["choices"][0]["message"]["content"]
    stop = full.split()[3]  # a word from the middle of the answer
    want = full[: full.index(stop)]
    r = post(url, "/v1/chat/completions", {**base, "stop": [stop]}).json()
    assert r["choices"][0]["message"]["content"] == want and r["choices"][0]["finish_reason"] == "stop"
    assert chat_text(stream(url, "/v1/chat/completions", {**base, "stop": stop})) == want


def test_seeded_sampling_is_reproducible_and_unseeded_is_not(sim_agg):
    url = sim_agg.url
    req = {"model": MODEL, "messages": FRANCE, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 24,
           "ignore_eos": True}
    texts = [post(url, "/v1/chat/completions", req).json()["choices"][0]["message"]["content"] for _ in range(2)]
    assert texts[0] == texts[1]
    other = post(url, "/v1/chat/completions", {**req, "seed": 99}).json()["choices"][0]["message"]["content"]
    assert other != texts[0]


def test_prefix_cache_reports_cached_tokens(sim_agg):
    long_user = "Summarize this text. " + " ".join(f"Sentence number {i} is about topic {i % 7}." for i in range(60))
    req = {"model": MODEL, "messages": [{"role": "user", "content": long_user}], "temperature": 0, "max_tokens": 4}
    first = post(sim_agg.url, "/v1/chat/completions", req).json()
    second = post(sim_agg.url, "/v1/chat/completions", req).json()
    n = first["usage"]["prompt_tokens"]
    # Only the chat template's opening block is shared with earlier requests.
    assert n > 256 and first["usage"]["prompt_tokens_details"]["cached_tokens"] <= 32
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and n - 16 <= cached < n  # every whole block of 16 but the last token's


def test_openai_client(sim_agg):
    import openai

    client = openai.OpenAI(base_url=f"{sim_agg.url}/v1", api_key="unused", timeout=60, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    resp = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    text = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        else:
            assert chunk.usage.completion_tokens == resp.usage.completion_tokens
    assert text == resp.choices[0].message.content
    assert client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                     max_tokens=5).choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=FRANCE)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=FRANCE, n=2)


def test_bad_inputs_get_envelopes_and_server_keeps_serving(sim_agg):
    url = f"{sim_agg.url}/v1/chat/completions"
    assert_envelope(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_envelope(httpx.post(url, json=[1, 2, 3]), 400)
    assert_envelope(httpx.post(url, json={"model": MODEL}), 400, "messages")
    assert_envelope(httpx.post(url, json={"messages": FRANCE}), 400, "model")
    assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "temperature": "hot"}), 400, "temperature")
    assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "n": 3}), 400, "n")
    assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "max_tokens": -1}), 400, "max_tokens")
    err = assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "max_tokens": 10,
                                                "min_tokens": 20}), 400, "min_tokens")
    err = assert_envelope(httpx.post(url, json={"model": "gpt-17", "messages": FRANCE}), 404, "model")
    assert err["code"] == "model_not_found"
    huge = "word " * 9000
    err = assert_envelope(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": huge}]},
                                     timeout=60), 400)
    assert "8192" in err["message"] and err["code"] == "context_length_exceeded"
    err = assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "max_tokens": 9000}), 400, "max_tokens")
    assert "8192" in err["message"]
    cmpl = f"{sim_agg.url}/v1/completions"
    assert_envelope(httpx.post(cmpl, json={"model": MODEL, "prompt": ["a", "b"]}), 400, "prompt")
    assert_envelope(httpx.post(cmpl, json={"model": MODEL, "prompt": [10**9]}), 400, "prompt")
    assert_envelope(httpx.post(cmpl, json={"model": MODEL, "prompt": ""}), 400, "prompt")
    assert_envelope(httpx.post(url, content=b"x" * (5 * 1024 * 1024), headers={"content-type": "application/json"},
                               timeout=60), 413)
    assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "stream": True, "top_p": 5}), 400, "top_p")
    assert_envelope(httpx.get(f"{sim_agg.url}/v1/nothing-here"), 404)
    r = post(sim_agg.url, "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "max_tokens": 5})
    assert r.status_code == 200


def test_route_explain_of_an_agg_deployment(sim_agg):
    r = post(sim_agg.url, "/v1/route/explain", {"model": MODEL, "messages": FRANCE})
    assert r.status_code == 200, r.text
    ex = r.json()
    assert ex["path"] == "agg" and ex["prefill"] is None and ex["decode"]["chosen"] == sim_agg.urls("agg")[0]
    assert_envelope(post(sim_agg.url, "/v1/route/explain", {"model": MODEL}), 400, "prompt")  # no messages: a completion


def test_metrics_count_requests(sim_agg):
    url = sim_agg.url
    before = httpx.get(f"{url}/metrics").text
    req = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    for _ in range(3):
        assert post(url, "/v1/chat/completions", req).status_code == 200
    stream(url, "/v1/chat/completions", req)
    assert post(url, "/v1/chat/completions", {**req, "model": "nope"}).status_code == 404
    after = httpx.get(f"{url}/metrics").text
    families = {f.name for f in text_string_to_metric_families(after)}
    for name in ("pdserve_frontend_requests", "pdserve_frontend_time_to_first_token_seconds",
                 "pdserve_frontend_inter_token_latency_seconds", "pdserve_frontend_request_duration_seconds",
                 "pdserve_frontend_input_sequence_tokens", "pdserve_frontend_output_sequence_tokens",
                 "pdserve_frontend_inflight_requests", "pdserve_frontend_worker_kv_usage_ratio",
                 "pdserve_frontend_workers"):
        assert name in families, name
    assert "pdserve_worker_kv_usage_ratio" not in families  # the worker's own name, not the frontend's copy

    def delta(name: str, labels: dict | None = None) -> float:
        return metric_value(after, name, labels) - metric_value(before, name, labels)

    ok = {"endpoint": "/v1/chat/completions", "status": "200"}
    assert delta("pdserve_frontend_requests_total", {**ok, "request_type": "unary"}) == 3
    assert delta("pdserve_frontend_requests_total", {**ok, "request_type": "stream"}) == 1
    assert delta("pdserve_frontend_requests_total", {"endpoint": "/v1/chat/completions", "status": "404"}) == 1
    assert delta("pdserve_frontend_time_to_first_token_seconds_count") == 4
    assert delta("pdserve_frontend_inter_token_latency_seconds_count") == 4 * 4
    assert delta("pdserve_frontend_output_sequence_tokens_sum") == 4 * 5
    assert metric_value(after, "pdserve_frontend_inflight_requests") == 0
    assert metric_value(after, "pdserve_frontend_workers", {"role": "agg"}) == 1


def test_worker_exports_the_vllm_series_pdserve_reads_and_says_it_is_simulated(sim_agg):
    worker = sim_agg.urls("agg")[0]
    text = httpx.get(f"{worker}/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prompt_tokens_by_source", "pdserve_worker_requests", "pdserve_kv_reads",
                 "pdserve_sim_engine_info"):
        assert name in families, name
    assert httpx.get(f"{worker}/info").json()["engine"] == "sim"
    rows = httpx.get(f"{sim_agg.url}/internal/workers").json()["workers"]
    assert [w["engine"] for w in rows] == ["sim"]
    load = httpx.get(f"{worker}/load").json()
    assert set(load) >= {"active_requests", "running_requests", "waiting_requests", "kv_usage"}


def test_client_disconnect_mid_stream_aborts_in_engine(sim_agg):
    worker = sim_agg.urls("agg")[0]
    wait_idle(worker)
    before = aborted_count(worker)
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{sim_agg.url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # kept referenced: dropping the iterator would close the stream
        n = 0
        while n < 5:
            n += sse.payload(next(lines)) is not None
        assert httpx.get(f"{worker}/load").json()["active_requests"] == 1
    wait_idle(worker, timeout=5)  # 4000 tokens would take 8 s
    assert aborted_count(worker) == before + 1
    assert httpx.get(f"{worker}/load").json()["kv_usage"] < 0.01


def test_client_disconnect_non_streaming_aborts_in_engine(sim_agg):
    worker = sim_agg.urls("agg")[0]
    wait_idle(worker)
    before = aborted_count(worker)
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim_agg.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(1.0))
    wait_idle(worker, timeout=5)
    assert aborted_count(worker) == before + 1


def test_no_worker_is_503_with_retry_after(model_dir):
    from tests.helpers.simthread import ThreadedSimCluster

    with ThreadedSimCluster(model_dir, []) as empty:
        url = empty.url
        assert httpx.get(f"{url}/health").status_code == 503
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == MODEL
        for stream_flag in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "stream": stream_flag})
            err = assert_envelope(r, 503)
            assert err["code"] == "no_worker_available"
            assert int(r.headers["retry-after"]) > 0
        assert_envelope(post(url, "/v1/route/explain", {"model": MODEL, "messages": FRANCE}), 503)


def test_internal_requests_lists_each_finished_request_exactly_once(sim_agg):
    url = sim_agg.url
    start = httpx.get(f"{url}/internal/requests", params={"since": 10**9}).json()  # a restarted reader: all
    seen = start["next"]
    req = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    assert post(url, "/v1/chat/completions", req).status_code == 200
    stream(url, "/v1/chat/completions", req)
    got = httpx.get(f"{url}/internal/requests", params={"since": seen}).json()
    samples = got["samples"]
    assert [s[0] for s in samples] == [seen + 1, seen + 2] and got["next"] == seen + 2  # [seq, arrival, ...]
    for seq, arrival, isl, osl, ttft, duration, ok in samples:
        assert ok and isl > 0 and osl == 6 and 0 < ttft <= duration and abs(arrival - time.time()) < 60
    assert got["arrivals"] >= start["arrivals"] + 2 and got["in_flight"] == 0 and got["dropped"] == 0
    again = httpx.get(f"{url}/internal/requests", params={"since": got["next"]}).json()
    assert again["samples"] == [] and again["next"] == got["next"]
    bad = httpx.get(f"{url}/internal/requests", params={"since": "-1"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
