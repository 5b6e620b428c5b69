"""The prefill worker's first token goes to the client and the decode worker continues after
it (`--first-token-from prefill`, the default), on simulated workers behind the real frontend:
the answer is the unsplit one, token for token and in its usage; the decode engine computes
no prompt token again (`pdserve_kv_decode_recomputed_prompt_tokens_total` stays 0, where the
old path computes one per request); a first token that ends the request frees the prefill's
blocks at once, with no decode request; min_tokens, stop strings and max_tokens count it."""

from __future__ import annotations

import asyncio
import json

from serve.sim.cluster import SimCluster
from tests.serve.sim.test_cluster import LONG, MODEL, metric, metrics

PROMPTS = ["Hello", LONG, "What is the capital of France?"]
# A long lease: a hold that is gone right after the answer was released, not expired.
LEASE = {"kv_lease_seconds": 120.0}


async def answer(c: SimCluster, prompt: str, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    r = await c.client.post(f"{c.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return {"text": out["choices"][0]["text"], "finish": out["choices"][0]["finish_reason"],
            "prompt": out["usage"]["prompt_tokens"], "completion": out["usage"]["completion_tokens"]}


CASES = [dict(max_tokens=12), dict(max_tokens=2), dict(max_tokens=1), dict(max_tokens=40, ignore_eos=True),
         dict(max_tokens=9, min_tokens=9)]


async def answers(model_dir: str, roles: list[str], first_from: str = "prefill") -> tuple[list[dict], dict, dict]:
    async with SimCluster(model_dir, roles, frontend={"first_token_from": first_from}, worker=LEASE) as c:
        got = [await answer(c, p, **case) for p in PROMPTS for case in CASES]
        if "prefill" in roles:
            await settled(c, c.urls("prefill")[0], 0)  # every hold read or released, none left
        by_role = {role: await metrics(c, c.urls(role)[0]) for role in set(roles)}
        return got, by_role, await metrics(c, c.url)


def test_split_answers_equal_unsplit_ones_and_the_decode_recomputes_nothing(model_dir):
    async def run() -> None:
        want, _, _ = await answers(model_dir, ["agg"])
        new, new_m, fe = await answers(model_dir, ["prefill", "decode"])
        old, old_m, _ = await answers(model_dir, ["prefill", "decode"], "decode")
        assert new == want and old == want
        assert any(a["finish"] == "stop" for a in want) and any(a["finish"] == "length" for a in want)
        n = len(want)
        one_token = sum(1 for case in CASES if case["max_tokens"] == 1) * len(PROMPTS)
        assert metric(fe, "pdserve_frontend_request_paths_total", path="disagg") == n
        # New path: the decode engine runs only the prefill's token after the load; requests
        # the prefill's token ended (max_tokens 1, or its token was EOS) never reach it.
        d = new_m["decode"]
        assert metric(d, "pdserve_kv_decode_recomputed_prompt_tokens_total") == 0
        assert metric(d, "pdserve_kv_reads_total") <= n - one_token
        assert metric(d, "pdserve_kv_recomputes_total") == 0
        # Old path: the last prompt token of every request again.
        assert metric(old_m["decode"], "pdserve_kv_decode_recomputed_prompt_tokens_total") == n
        # Every hold was read or released, none left to its (2-minute) lease.
        assert metric(new_m["prefill"], "pdserve_kv_held_blocks") == 0
        assert metric(new_m["prefill"], "pdserve_kv_lease_expiries_total") == 0

    asyncio.run(run())


async def settled(c: SimCluster, url: str, held: int) -> dict:
    """The worker's metrics once its KV stats show `held` requests held so far and no block
    held now (the holder frees released blocks, and the stats are exported, a moment after the
    release). Within 5 s, where the lease is 2 minutes: a release, not the lease."""
    for _ in range(100):
        m = await metrics(c, url)
        if metric(m, "pdserve_kv_held_requests_total") >= held and metric(m, "pdserve_kv_held_blocks") == 0:
            return m
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url}: {held} held requests not reported, or their blocks still held")


def test_a_first_token_that_ends_the_request_releases_the_prefill_blocks_at_once(model_dir):
    async def run() -> None:
        async with SimCluster(model_dir, ["prefill", "decode"], worker=LEASE) as c:
            pf, dec = c.urls("prefill")[0], c.urls("decode")[0]
            before = await metrics(c, dec)
            got = await answer(c, LONG, max_tokens=1)
            assert (got["completion"], got["finish"]) == (1, "length")
            m = await settled(c, pf, 1)
            assert metric(m, "pdserve_kv_blocks_released_total") > 0  # by the frontend, not by the lease
            assert metric(m, "pdserve_kv_held_blocks") == 0
            assert metric(m, "pdserve_kv_lease_expiries_total") == 0
            after = await metrics(c, dec)
            assert metric(after, "pdserve_worker_requests_total", role="decode", outcome="ok") == \
                metric(before, "pdserve_worker_requests_total", role="decode", outcome="ok")
            # A stop string the first token completes: the same.
            first_word = got["text"].strip()
            stopped = await answer(c, LONG, max_tokens=8, stop=[first_word])
            assert (stopped["completion"], stopped["finish"], stopped["text"].strip()) == (1, "stop", "")
            m = await settled(c, pf, 2)
            assert metric(m, "pdserve_kv_held_blocks") == 0 and metric(m, "pdserve_kv_lease_expiries_total") == 0
            # A second release of the same request finds nothing held.
            r = await c.client.post(f"{pf}/kv/release", json={"request_id": "never-held"})
            assert r.status_code == 200 and r.json()["released"] is False
            r = await c.client.post(f"{pf}/kv/release", json={"id": 3})
            assert r.status_code == 400 and "invalid release request" in r.json()["error"]

    asyncio.run(run())


def test_streamed_split_answer_arrives_token_by_token_from_the_first(model_dir):
    async def run() -> None:
        async with SimCluster(model_dir, ["prefill", "decode"], worker=LEASE) as c:
            body = {"model": MODEL, "prompt": LONG, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            texts, usage = [], None
            async with c.client.stream("POST", f"{c.url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        texts += [ch["text"] for ch in chunk["choices"]]
            unary = await answer(c, LONG, max_tokens=6, ignore_eos=True)
            assert "".join(texts) == unary["text"]
            assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == unary["prompt"]

    asyncio.run(run())


def test_explain_says_who_gives_the_first_token(model_dir):
    async def run() -> None:
        async with SimCluster(model_dir, ["prefill", "decode"]) as c:
            async def explain(**extra) -> dict:
                r = await c.client.post(f"{c.url}/v1/route/explain", json={"model": MODEL, "prompt": LONG, **extra})
                assert r.status_code == 200, r.text
                return r.json()

            assert (await explain())["first_token_from"] == "prefill"
            # A seeded request keeps the old path: the decode engine's sampler draws from the start.
            assert (await explain(seed=7, temperature=1.0))["first_token_from"] == "decode"
        async with SimCluster(model_dir, ["agg"]) as c:
            r = await c.client.post(f"{c.url}/v1/route/explain", json={"model": MODEL, "prompt": LONG})
            assert r.json()["first_token_from"] is None

    asyncio.run(run())


def test_seeded_split_requests_repeat_the_unsplit_answer(model_dir):
    async def run() -> None:
        body = dict(max_tokens=10, temperature=1.0, seed=11)
        async with SimCluster(model_dir, ["agg"]) as c:
            want = await answer(c, LONG, **body)
        async with SimCluster(model_dir, ["prefill", "decode"], worker=LEASE) as c:
            assert await answer(c, LONG, **body) == want

    asyncio.run(run())
