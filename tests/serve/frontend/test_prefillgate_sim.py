"""A burst's backlog and the workers that join for it, end to end (real frontend, real HTTP,
simulated workers): with `--max-prefills-per-worker` the backlog waits in the frontend and a
prefill worker that joins takes part of it, which it cannot when every prompt is already
queued on the first worker's engine; the autoscaler counts the held requests as the prefill
pool's backlog; and a split request's decode worker is chosen as its prefill ends, so a
decode worker that joined meanwhile can take it."""

from __future__ import annotations

import asyncio
import threading

import httpx

from serve.autoscale.live import LiveObserver
from tests.conftest import MODEL
from tests.helpers.simthread import ThreadedSimCluster
from tests.helpers.workerclient import metric, metrics, wait_for

FAST = ["--max-num-seqs", "16", "--block-size", "16", "--num-gpu-blocks", "2048", "--sim-step-model", "constant:0.002"]
SLOW = [*FAST[:-1], "constant:0.75"]  # a prefill worker at 0.75 s a step: one prompt a step
N = 8


def prefills(url: str) -> float:
    return metric(metrics(url), "pdserve_worker_requests_total", role="prefill", outcome="ok")


def held(url: str) -> int:
    return httpx.get(f"{url}/internal/requests", timeout=10).json()["prefill_held"]


async def prefill_backlog(url: str) -> int:
    async with httpx.AsyncClient(timeout=10) as client:
        obs = await LiveObserver([url], ("prefill", "decode"), 30.0).observe(client)
    return obs.pools["prefill"].waiting


def run(model_dir: str, cap: int) -> tuple[float, float, list[int], float]:
    """N chats at once on one slow prefill worker; a second (slow) one joins once the first
    has its backlog. What each prefill worker served, the answers' statuses, the fallbacks."""
    with ThreadedSimCluster(model_dir, ["prefill", "decode"], engine_flags=FAST,
                            per_worker={0: {"engine_flags": SLOW}},
                            frontend={"max_prefills_per_worker": cap, "prefill_timeout_s": 60.0}) as c:
        statuses: list[int] = []

        def chat(i: int) -> None:
            r = httpx.post(f"{c.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": f"Request {i}: name a colour."}]})
            statuses.append(r.status_code)

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        first = c.urls("prefill")[0]
        if cap:
            wait_for(lambda: held(c.url) >= N - 2 * cap, 10, "a backlog held in the frontend")
            # The autoscaler counts what the frontend holds as the prefill pool's backlog.
            assert asyncio.run(prefill_backlog(c.url)) >= N - 4 * cap
        else:
            # Every prompt on the first worker: queued or running there, or already served by it.
            wait_for(lambda: httpx.get(f"{first}/load", timeout=5).json()["active_requests"] + prefills(first) >= N,
                     10, "the backlog on the first worker")
        second = c.add_worker("prefill", engine_flags=SLOW)
        for t in threads:
            t.join(60)
        assert held(c.url) == 0
        fallbacks = sum(v for (name, _), v in metrics(c.url).items()
                        if name == "pdserve_frontend_prefill_fallbacks_total")
        return prefills(first), prefills(second), statuses, fallbacks


def test_a_joining_prefill_worker_takes_part_of_the_backlog_held_in_the_frontend(model_dir):
    first, second, statuses, fallbacks = run(model_dir, cap=1)
    assert statuses == [200] * N and fallbacks == 0
    assert first + second == N and second >= 2, (first, second)
    # Without the gate every prompt is already in the first worker's queue: the new one idles.
    first, second, statuses, fallbacks = run(model_dir, cap=0)
    assert statuses == [200] * N and fallbacks == 0
    assert (first, second) == (N, 0)


def decoded(url: str) -> float:
    return metric(metrics(url), "pdserve_worker_requests_total", role="decode", outcome="ok")


def test_a_split_request_s_decode_worker_is_chosen_as_its_prefill_ends(model_dir):
    """At arrival only a busy decode worker exists; an idle one joins during the prefill: the
    request is decoded there (chosen at arrival, it would queue behind the busy one's streams)."""
    slow_decode = [*FAST[:-1], "constant:0.05"]  # 200 tokens: 10 s of streaming
    # The late request's prefill lasts 4 s: time for the new decode worker to start and
    # register on a loaded CI host (1.5 s was close), well within the streams' 10 s.
    slower_prefill = [*FAST[:-1], "constant:4.0"]
    with ThreadedSimCluster(model_dir, ["prefill", "decode"], engine_flags=FAST,
                            per_worker={0: {"engine_flags": slower_prefill}, 1: {"engine_flags": slow_decode}}) as c:
        busy = c.urls("decode")[0]
        statuses: list[int] = []

        def chat(tokens: int) -> None:
            r = httpx.post(f"{c.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Count to {tokens}."}]})
            statuses.append(r.status_code)

        streams = [threading.Thread(target=chat, args=(200,)) for _ in range(2)]
        for t in streams:
            t.start()
        wait_for(lambda: httpx.get(f"{busy}/load", timeout=5).json()["active_requests"] >= 2, 20,
                 "two long streams on the first decode worker")
        late = threading.Thread(target=chat, args=(2,))
        late.start()
        idle = c.add_worker("decode")
        wait_for(lambda: idle in c.in_rotation("decode"), 5, "the second decode worker in rotation")
        late.join(30)
        assert statuses == [200] and decoded(idle) == 1 and decoded(busy) == 0, (statuses, decoded(idle))
        for t in streams:
            t.join(30)
        assert statuses == [200] * 3 and decoded(busy) == 2
