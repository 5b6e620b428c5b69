"""Latency the frontend reports is the client's, in every path (simulated workers whose every
engine step takes STEP_S, the real frontend over real HTTP):

- a stream sends nothing before the first token exists (as vLLM's server: the chat's role
  chunk goes out with it), so a client stamping TTFT at the first chunk measures the real one;
- `pdserve_frontend_time_to_first_token_seconds` and the request duration count from the
  request's arrival at the frontend, so a disaggregated request's TTFT includes its prefill.

Bounds, not timings: a first token needs at least one engine step (two when disaggregated:
the prefill's and the decode's), and the frontend observes it between the client's send and
the client's receipt, so each bound holds however slow the machine is.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers.openai import metric_value
from tests.helpers.procs import MODEL
from tests.helpers.simthread import ThreadedSimCluster
from tests.helpers.workerclient import wait_for

STEP_S = 0.1
FLAGS = ["--max-num-seqs", "8", "--block-size", "16", "--num-gpu-blocks", "512", "--sim-step-model",
         f"constant:{STEP_S}"]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def stream(url: str, kind: str) -> tuple[float, list[dict]]:
    """(seconds to the first SSE chunk, the chunks) as the client sees them."""
    path, body = (("/v1/chat/completions", {"messages": FRANCE}) if kind == "chat"
                  else ("/v1/completions", {"prompt": "The capital of France is"}))
    chunks: list[dict] = []
    first = None
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}{path}", timeout=60, json={
            "model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first = first if first is not None else time.monotonic() - t0
                chunks.append(json.loads(line[6:]))
    return first, chunks


def frontend_histogram(url: str, name: str) -> tuple[float, float]:
    """(count, sum) of a frontend histogram."""
    text = httpx.get(f"{url}/metrics").text
    return metric_value(text, f"{name}_count"), metric_value(text, f"{name}_sum")


@pytest.mark.parametrize("roles,first_from,steps", [
    (["agg"], "prefill", 1),
    # The prefill's own token goes to the client: one step, as aggregated.
    (["prefill", "decode"], "prefill", 1),
    # The old path: the decode worker regenerates it, a step after the prefill's.
    (["prefill", "decode"], "decode", 2)], ids=["agg", "disagg", "disagg-first-token-from-decode"])
def test_ttft_counts_from_arrival_and_the_first_chunk_waits_for_the_first_token(model_dir, roles, first_from, steps):
    with ThreadedSimCluster(model_dir, roles, engine_flags=FLAGS, frontend={"first_token_from": first_from}) as c:
        for kind in ("chat", "completions"):
            n0, ttft0 = frontend_histogram(c.url, "pdserve_frontend_time_to_first_token_seconds")
            d0, dur0 = frontend_histogram(c.url, "pdserve_frontend_request_duration_seconds")
            first, chunks = stream(c.url, kind)
            n1, ttft1 = frontend_histogram(c.url, "pdserve_frontend_time_to_first_token_seconds")
            # The duration is observed as the stream closes, maybe just after the client's last read.
            d1, dur1 = wait_for(lambda: (h := frontend_histogram(c.url, "pdserve_frontend_request_duration_seconds"))[0]
                                > d0 and h, 10, "the request's duration observed")
            ttft, duration = ttft1 - ttft0, dur1 - dur0
            assert (n1 - n0, d1 - d0) == (1, 1)
            # The first token needs `steps` engine steps, disaggregated ones the prefill's too.
            assert ttft >= steps * STEP_S, (kind, ttft)
            # The frontend's clock runs inside the client's: from arrival, not from a later stage.
            assert ttft <= first, (kind, ttft, first)
            # From arrival too: the first token's steps and two more tokens, a step each. (Not
            # ttft + 2 steps: on a busy machine the frontend may see the first token late, and
            # the next ones then less than a step after it.)
            assert duration >= (steps + 2) * STEP_S, (kind, duration)
            assert duration >= ttft
            # Nothing before the first token: the first chunk arrives after it exists.
            assert first >= steps * STEP_S, (kind, first)
            if kind == "chat":
                assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert chunks[1]["choices"][0]["delta"].get("content")
            text = "".join((ch["choices"][0].get("delta") or {}).get("content") or ch["choices"][0].get("text") or ""
                           for ch in chunks if ch.get("choices"))
            assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_latency_buckets_read_a_p90_to_within_10_percent_around_common_targets():
    """TTFT 100 ms - 2 s and ITL 5 - 50 ms: within a bucket a quantile is off by at most the
    bucket's width, so each bound is at most 1.1 times the one below it there."""
    from serve.frontend.metrics import ITL_BUCKETS, LATENCY_BUCKETS

    for buckets, lo, hi in ((LATENCY_BUCKETS, 0.1, 2.0), (ITL_BUCKETS, 0.005, 0.05)):
        assert list(buckets) == sorted(set(buckets))
        inside = [b for b in buckets if lo <= b <= hi]
        assert inside[0] == lo and next(b for b in buckets if b > hi) / inside[-1] <= 1.1
        assert max(b / a for a, b in zip(inside, inside[1:])) <= 1.1, buckets


PATHS = [(["agg"], "prefill", {"queue", "tokenize", "route", "prefill", "other"}),
         (["prefill", "decode"], "prefill", {"queue", "tokenize", "route", "prefill", "other"}),
         (["prefill", "decode"], "decode",
          {"queue", "tokenize", "route", "prefill", "kv_transfer", "decode_first_step", "other"})]


@pytest.mark.parametrize("roles,first_from,stages", PATHS, ids=["agg", "disagg", "disagg-first-token-from-decode"])
def test_stages_add_up_to_the_ttft_and_come_back_on_request(model_dir, roles, first_from, stages):
    with ThreadedSimCluster(model_dir, roles, engine_flags=FLAGS, frontend={"first_token_from": first_from}) as c:
        body = {"model": MODEL, "messages": FRANCE, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{c.url}/v1/chat/completions", json=body, timeout=60)
        assert "x-pdserve-timing" not in plain.headers  # only on request
        n0 = metric_value(httpx.get(f"{c.url}/metrics").text, "pdserve_frontend_stage_seconds_count",
                          {"stage": "prefill"})
        r = httpx.post(f"{c.url}/v1/chat/completions", json=body, timeout=60, headers={"X-PDSERVE-Timing": "1"})
        assert r.status_code == 200, r.text
        unary = json.loads(r.headers["x-pdserve-timing"])
        with httpx.stream("POST", f"{c.url}/v1/chat/completions", timeout=60, headers={"X-PDSERVE-Timing": "1"},
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert "pdserve_timing" not in chunks[0] and chunks[-1]["usage"]  # the last chunk carries it
        streamed = chunks[-1]["pdserve_timing"]
        for t in (unary, streamed):
            assert t["path"] == ("agg" if roles == ["agg"] else "disagg")
            assert set(t["stages_ms"]) == stages, t
            assert all(v >= 0 for v in t["stages_ms"].values())
            assert abs(sum(t["stages_ms"].values()) - t["ttft_ms"]) <= 5.0, t
            # The engine's steps sit in the stage that ran them.
            first_steps = t["stages_ms"]["decode_first_step"] if first_from == "decode" else t["stages_ms"]["prefill"]
            assert first_steps >= STEP_S * 1e3, t
            if first_from == "decode":  # the prefill ran its own step before that
                assert t["stages_ms"]["prefill"] >= STEP_S * 1e3, t
        n1 = metric_value(httpx.get(f"{c.url}/metrics").text, "pdserve_frontend_stage_seconds_count",
                          {"stage": "prefill"})
        assert n1 - n0 == 2
