"""Disaggregated serving end to end: frontend + prefill worker(s) + decode worker, real HTTP.

Greedy answers equal aggregated mode's (the prefill's own first token goes to the client and
the decode engine continues after it, computing no prompt token again), the prefill worker
really serves the prompts (its request counter) with no fallback, KV-aware routing sends shared prefixes back to the
worker that has them. It runs on the session's real cluster (tests/helpers/realcluster.py), which
tests/serve/test_faults.py then breaks on purpose. (Losing a prefill worker, and other
faults: test_faults.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from serve.common import sse
from tests.helpers.procs import MODEL
from tests.helpers.workerclient import metric, metrics, reset_prefix_cache, wait_for

pytestmark = pytest.mark.engine

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Count from one to ten in words, separated by commas."}],
]


@pytest.fixture(scope="module")
def disagg(real_disagg):
    """The session's real cluster (tests/helpers/realcluster.py), before test_faults breaks it."""
    return real_disagg


def chat(url: str, messages, stream: bool = False, **kw) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 40, **kw}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0]["message"]["content"], j["usage"]
    text, usage = "", {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for ev in sse.events(r.iter_lines()):
            assert "error" not in ev, ev
            if ev.get("choices"):
                text += ev["choices"][0]["delta"].get("content") or ""
            if ev.get("usage"):
                usage = ev["usage"]
    return text, usage


def test_disagg_answers_equal_agg_and_prefill_worker_serves(disagg, frontend):
    furl = disagg.frontend
    p0, d0, f0 = metrics(disagg.urls["prefill"]), metrics(disagg.urls["decode1"]), metrics(furl)
    for messages in PROMPTS:
        agg_text, agg_usage = chat(frontend, messages)
        for stream in (False, True):
            text, usage = chat(furl, messages, stream=stream)
            assert text == agg_text, (messages, stream)
            assert usage["completion_tokens"] > 0
            # The client's prompt, and the prefill's token counted once.
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (agg_usage["prompt_tokens"],
                                                                            agg_usage["completion_tokens"])
    p1, d1, f1 = metrics(disagg.urls["prefill"]), metrics(disagg.urls["decode1"]), metrics(furl)

    def fallbacks(m) -> float:
        return sum(v for (n, _), v in m.items() if n == "pdserve_frontend_prefill_fallbacks_total")

    assert fallbacks(f1) == fallbacks(f0)
    assert (metric(f1, "pdserve_frontend_request_paths_total", path="disagg")
            - metric(f0, "pdserve_frontend_request_paths_total", path="disagg")) == 6
    served = (metric(p1, "pdserve_worker_requests_total", role="prefill", outcome="ok")
              - metric(p0, "pdserve_worker_requests_total", role="prefill", outcome="ok"))
    assert served == 6
    assert metric(d1, "pdserve_kv_reads_total") - metric(d0, "pdserve_kv_reads_total") >= 3
    # The decode engine ran only the prefill's token after each load: no prompt token again.
    recomputed = "pdserve_kv_decode_recomputed_prompt_tokens_total"
    assert any(name == recomputed for name, _ in d1)  # exported (a missing one would read 0 too)
    assert metric(d1, recomputed) - metric(d0, recomputed) == 0
    # The request id reaches both workers' logs.
    rid = "disagg-trace-1"
    r = httpx.post(f"{furl}/v1/chat/completions", headers={"x-request-id": rid}, timeout=60,
                   json={"model": MODEL, "messages": PROMPTS[0], "max_tokens": 4})
    assert r.headers["x-request-id"] == rid
    p_proc, d_proc = disagg.procs["prefill"], disagg.procs["decode1"]
    wait_for(lambda: f"request {rid}" in p_proc.log_path.read_text() and f"request {rid}" in d_proc.log_path.read_text(),
             10, "request id in both workers' logs")


def test_real_kv_events_reach_the_routers_index(disagg):
    """vLLM's own BlockStored events (not a simulator's) feed the router: after a long prompt
    ran on the prefill worker, the dry run sees its blocks cached there, and the follow-up
    reports them as cached tokens. (Routing itself is tested on simulated workers in
    tests/serve/frontend/test_routing_sim.py.)"""
    furl = disagg.frontend
    prefix = "Document. " + " ".join(f"Fact {j}: value {(j * 7) % 101}." for j in range(90))
    first = [{"role": "system", "content": prefix}, {"role": "user", "content": "Summarize fact 3."}]
    chat(furl, first, max_tokens=4)
    follow = [{"role": "system", "content": prefix}, {"role": "user", "content": "Now summarize fact 9."}]

    def indexed():
        ex = httpx.post(f"{furl}/v1/route/explain", json={"model": MODEL, "messages": follow}, timeout=30).json()
        return ex if ex["prefill"]["workers"][0]["overlap_blocks"] > 0 else None

    ex = wait_for(indexed, 15, "the prefill worker's KV events in the router's index")
    assert ex["prefill"]["chosen"] == disagg.urls["prefill"] and ex["prefill"]["cached_ratio"] > 0
    _, usage = chat(furl, follow, max_tokens=4)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 128  # whole CPU blocks of 128 tokens


# The suite keeps four of them (the Romeo and Juliet prompt first); `pdserve bench first-token`
# and `python -m bench.perf.near_ties` cover more.
NEAR_TIES = json.loads((Path(__file__).parent / "data" / "near_ties.json").read_text())["prompts"][:4]


def completion_ids(url: str, prompt_ids: list[int], max_tokens: int = 32) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt_ids, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_split_answers_equal_unsplit_ones_at_near_ties_and_block_edges(disagg, frontend, agg_worker, tokenizer):
    """Greedy, 32 tokens each, the same (empty) prefix cache on the engine that computes the
    prompt: prompts whose answers pass through exact bf16 ties (tests/serve/data/near_ties.json,
    made by `python -m bench.perf.near_ties`, the issue's Romeo and Juliet prompt first), and
    prompts of 1 token and at the 128-token block edge."""
    def fresh() -> None:
        for url in (agg_worker, disagg.urls["prefill"], disagg.urls["decode1"]):
            reset_prefix_cache(url)

    d0 = metrics(disagg.urls["decode1"])
    for case in NEAR_TIES:
        fresh()
        want, _ = chat(frontend, case["messages"], max_tokens=32, ignore_eos=True)
        fresh()
        got, _ = chat(disagg.frontend, case["messages"], max_tokens=32, ignore_eos=True)
        assert got == want, case["messages"][0]["content"][:60]
    words = tokenizer.encode(" ".join(f"word{i}" for i in range(300)), add_special_tokens=False)
    lengths = (1, 128, 129)  # one token; a whole block; one past it
    for n in lengths:
        fresh()
        want = completion_ids(frontend, words[:n])
        fresh()
        assert completion_ids(disagg.frontend, words[:n]) == want, n
    d1 = metrics(disagg.urls["decode1"])
    recomputed = "pdserve_kv_decode_recomputed_prompt_tokens_total"
    assert metric(d1, recomputed) - metric(d0, recomputed) == 0
    assert metric(d1, "pdserve_kv_reads_total") - metric(d0, "pdserve_kv_reads_total") == len(NEAR_TIES) + len(lengths)
