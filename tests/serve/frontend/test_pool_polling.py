"""The pool's load polls at scale: spread over the cycle in small batches, and a cycle that
grows past the poll budget, so a thousand workers are not polled in one burst."""

import asyncio
import time

import httpx

from serve.frontend.pool import WorkerPool


def pool_of(n: int, seen: list[tuple[float, int]], budget: float = 250.0) -> WorkerPool:
    inflight = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal inflight
        inflight += 1
        seen.append((time.monotonic(), inflight))
        await asyncio.sleep(0.002)
        inflight -= 1
        return httpx.Response(503)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    urls = [f"http://w{i}:1" for i in range(n)]
    return WorkerPool("m", urls, poll_interval_s=1.0, max_failures=3, client=client, poll_budget_per_s=budget)


async def test_a_spread_poll_runs_in_small_batches_over_the_cycle():
    seen: list[tuple[float, int]] = []
    pool = pool_of(200, seen)
    t0 = time.monotonic()
    await pool.poll_once(spread_s=0.5)
    assert len(seen) == 200  # every worker once
    assert max(k for _, k in seen) <= 20  # 10 batches of 20, never the 200 at once
    assert seen[-1][0] - t0 >= 0.4  # the last batch near the cycle's end
    seen.clear()
    await pool.poll_once()  # unspread (start-up, tests): all at once
    assert max(k for _, k in seen) == 200


def test_the_cycle_grows_past_the_poll_budget():
    assert pool_of(100, []).cycle_s() == 1.0  # the poll interval
    assert pool_of(1000, []).cycle_s() == 4.0  # 1,000 workers at 250 polls/s
    assert pool_of(1000, [], budget=2000).cycle_s() == 1.0
