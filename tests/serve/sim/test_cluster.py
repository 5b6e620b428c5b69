"""The real frontend in front of simulated workers, all in this process on loopback
sockets: disaggregation is token-identical to aggregation, a few dozen workers share the
load, a prefill worker killed mid-request and a decode worker whose lease ran out both
still give the client the right answer."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from serve.sim.cluster import SimCluster

MODEL = "smollm2-135m-instruct"
LONG = "Tell me everything about the history of the Roman empire, from its founding to its fall. " * 3


async def metrics(c: SimCluster, url: str) -> dict[tuple[str, tuple], float]:
    text = (await c.client.get(f"{url}/metrics")).text
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))))
            out[key] = out.get(key, 0.0) + s.value
    return out


def metric(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


async def complete(c: SimCluster, prompt: str, max_tokens: int = 24, **extra) -> dict:
    r = await c.client.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                             "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def agg_answer(model_dir: str, prompt: str, max_tokens: int = 24) -> str:
    async with SimCluster(model_dir, ["agg"]) as c:
        return (await complete(c, prompt, max_tokens))["choices"][0]["text"]


def test_disaggregated_answers_equal_aggregated_ones(model_dir):
    async def run() -> None:
        prompts = ["Hello", LONG, "What is the capital of France?"]
        want = [await agg_answer(model_dir, p) for p in prompts]
        async with SimCluster(model_dir, ["prefill", "decode"]) as c:
            got = [(await complete(c, p))["choices"][0]["text"] for p in prompts]
            m = await metrics(c, c.url)
            d = await metrics(c, c.urls("decode")[0])
            pf = await metrics(c, c.urls("prefill")[0])
        assert got == want and all(want)
        assert metric(m, "pdserve_frontend_request_paths_total", path="disagg") == 3
        assert metric(d, "pdserve_kv_reads_total") == 3 and metric(d, "pdserve_kv_recomputes_total") == 0
        assert metric(d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
        assert metric(pf, "pdserve_kv_held_requests_total") == 3
        assert metric(pf, "pdserve_kv_held_blocks") == 0  # every hold released by its reader

    asyncio.run(run())


def test_a_few_dozen_workers_share_the_load_through_a_kill_and_expired_leases(model_dir):
    """24 workers behind the real frontend, 96 concurrent requests: one prefill worker (slow)
    is killed while it holds requests, and one decode worker reads too late for the 0.3 s
    leases. Every client still gets exactly the unsplit answer."""
    flags = ["--max-num-seqs", "4", "--block-size", "16", "--num-gpu-blocks", "256", "--sim-step-model", "constant:0.01"]
    roles = ["prefill"] * 12 + ["decode"] * 12

    async def run() -> None:
        prompts = [f"request {i}: " + LONG[: 40 + 7 * i] for i in range(96)]
        # The reference answers (a pure function of the prompt, whatever the batch) from one
        # worker that takes them all at once.
        ref_flags = ["--max-num-seqs", "96", *flags[2:]]
        async with SimCluster(model_dir, ["agg"], engine_flags=ref_flags) as ref:
            want = [a["choices"][0]["text"] for a in await asyncio.gather(*(complete(ref, p, 16) for p in prompts))]
        slow = {"engine_flags": [*flags[:-1], "constant:3"]}
        per_worker = {i: {"kv_lease_seconds": 0.3} for i in range(12)}
        per_worker[0] = {**slow, "kv_lease_seconds": 0.3}
        per_worker[12] = {"kv_fault_pause_s": 1.0}
        async with SimCluster(model_dir, roles, engine_flags=flags, per_worker=per_worker) as c:
            victim, late = c.urls("prefill")[0], c.urls("decode")[0]
            tasks = [asyncio.create_task(complete(c, p, 16)) for p in prompts]
            for _ in range(300):  # until the slow prefill worker holds requests
                if c.workers[victim].active:
                    break
                await asyncio.sleep(0.01)
            assert c.workers[victim].active >= 1
            await c.kill(victim)
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            await asyncio.sleep(0.2)  # holders report expiries at their next settle
            m = await metrics(c, c.url)
            served = {url: metric(await metrics(c, url), "pdserve_worker_requests_total", role=w.settings.role,
                                  outcome="ok") for url, w in c.workers.items()}
            late_m = await metrics(c, late)
            expiries = sum([metric(await metrics(c, u), "pdserve_kv_lease_expiries_total") for u in c.urls("prefill")])
            decode = c.urls("decode")
        assert [a["choices"][0]["text"] for a in answers] == want
        fallbacks = sum(v for (name, _), v in m.items() if name == "pdserve_frontend_prefill_fallbacks_total")
        assert fallbacks >= 1  # the killed worker's requests
        assert metric(late_m, "pdserve_kv_recomputes_total") >= 1 and expiries >= 1
        assert metric(m, "pdserve_frontend_request_paths_total", path="disagg") == 96
        assert min(served[u] for u in decode) >= 1, served  # no decode worker left idle
        assert max(served[u] for u in decode) <= 24, served  # nor one taking a quarter of them

    asyncio.run(run())


def test_prefill_killed_mid_request_falls_back_with_the_same_answer(model_dir):
    async def run() -> None:
        want = await agg_answer(model_dir, LONG)
        slow = {"engine_flags": ["--block-size", "16", "--num-gpu-blocks", "512", "--sim-step-model", "constant:2"]}
        async with SimCluster(model_dir, ["prefill", "decode"], per_worker={0: slow}) as c:
            prefill = c.urls("prefill")[0]
            task = asyncio.create_task(complete(c, LONG))
            for _ in range(200):  # until the prefill worker has the request
                if c.workers[prefill].active:
                    break
                await asyncio.sleep(0.01)
            assert c.workers[prefill].active == 1
            await c.kill(prefill)
            got = (await asyncio.wait_for(task, 30))["choices"][0]["text"]
            m = await metrics(c, c.url)
        assert got == want
        fallbacks = sum(v for (name, _), v in m.items() if name == "pdserve_frontend_prefill_fallbacks_total")
        assert fallbacks == 1

    asyncio.run(run())


def test_decode_after_lease_expiry_recomputes_the_right_answer(model_dir):
    async def run() -> None:
        want = await agg_answer(model_dir, LONG)
        async with SimCluster(model_dir, ["prefill", "decode"], per_worker={
                0: {"kv_lease_seconds": 0.2}, 1: {"kv_fault_pause_s": 1.0}}) as c:
            got = (await complete(c, LONG))["choices"][0]["text"]
            d = await metrics(c, c.urls("decode")[0])
            await asyncio.sleep(0.2)  # the holder reports its expiry at its next settle
            pf = await metrics(c, c.urls("prefill")[0])
        assert got == want
        assert metric(d, "pdserve_kv_recomputes_total") == 1 and metric(d, "pdserve_kv_reads_total") == 0
        assert metric(pf, "pdserve_kv_lease_expiries_total") == 1
        assert metric(pf, "pdserve_kv_held_blocks") == 0

    asyncio.run(run())
