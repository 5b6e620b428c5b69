"""A stalled frontend does not expire its workers' leases: the time its event loop stood still
is measured (serve/frontend/loopstall.py) and leases run on the clock less that time; a worker
that stops renewing still leaves once the loop runs again."""

from __future__ import annotations

import asyncio
import time

import httpx

from serve import protocol as p
from serve.frontend.loopstall import LoopStall
from serve.frontend.pool import WorkerPool
from serve.frontend.routing import Routing
from serve.frontend.settings import FrontendSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(i: int, role: str) -> p.WorkerInfo:
    return p.WorkerInfo(worker_id=f"w{i}", role=role, url=f"http://w{i}", model="m",  # type: ignore[arg-type]
                        served_model_name="m", max_model_len=4096, block_size=16, kv_cache_dtype="auto")


def test_jitter_is_not_a_stall_and_stalls_add_up():
    s = LoopStall()
    s.observe(0.01)
    s.observe(LoopStall.SLACK_S)
    assert s.stalled_s == 0.0
    s.observe(2.0)
    s.observe(0.5)
    assert s.stalled_s == 2.5 and s.longest_s == 2.0


async def test_a_blocked_loop_is_measured():
    s = LoopStall()
    s.start()
    await asyncio.sleep(0.15)  # a tick under way
    time.sleep(0.8)  # the loop blocked, as by a starved process or a long callback
    await asyncio.sleep(0.25)  # the tick that overslept lands
    await s.stop()
    assert s.stalled_s >= 0.6
    assert s.longest_s >= 0.6
    assert s._task is None


def test_leases_do_not_run_while_the_loop_stalls_and_do_after():
    clock, stall = Clock(), LoopStall()
    pool = WorkerPool("m", [], 1.0, 3, client=None, clock=clock, stall=stall)  # type: ignore[arg-type]
    plain = WorkerPool("m", [], 1.0, 3, client=None, clock=clock)  # type: ignore[arg-type]
    for pl in (pool, plain):
        pl.register(p.Registration(info=info(1, "decode"), lease_seconds=10))
    routing = Routing(FrontendSettings(model="m", served_model_name="m", block_size=16), pool)
    assert [e.url for e in routing.eligible(("decode",))] == ["http://w1"]

    # 14 s pass, 8 of them with the loop stalled: the renewals sent then were not read yet
    clock.now += 14
    stall.observe(8.0)
    assert [e.url for e in pool.available(("decode",))] == ["http://w1"]
    assert [e.url for e in routing.eligible(("decode",))] == ["http://w1"]
    assert plain.available(("decode",)) == []  # without the meter: the lease ran out

    # a renewal read late restores the full lease from the stall-free clock
    pool.register(p.Registration(info=info(1, "decode"), lease_seconds=10))
    clock.now += 9
    assert routing.eligible(("decode",))
    # no renewal and no stall: the lease runs out, and the cached eligible list sees it
    clock.now += 2
    assert pool.available(("decode",)) == []
    assert routing.eligible(("decode",)) == []


async def test_a_frontend_pool_meters_its_loop_and_stops_the_meter():
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        stall = LoopStall()
        pool = WorkerPool("m", [], 100.0, 3, client=client, stall=stall)
        await pool.start()
        pool.register(p.Registration(info=info(1, "decode"), lease_seconds=1.0))
        await asyncio.sleep(0.15)
        time.sleep(1.5)  # blocked past the 1-s lease: renewals could not have been read
        await asyncio.sleep(0.15)
        assert [e.url for e in pool.available(("decode",))] == ["http://w1"]
        await asyncio.sleep(1.0)  # running, and no renewal comes: the worker leaves
        assert pool.available(("decode",)) == []
        await pool.stop()
        assert stall._task is None


async def test_a_poll_that_fails_while_the_frontend_stalls_is_not_the_workers_failure():
    block = True

    async def handler(request: httpx.Request) -> httpx.Response:
        if block:
            time.sleep(1.5)  # this frontend's loop stands still; the poll's timeout runs out meanwhile
        raise httpx.ReadTimeout("timed out", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        stall = LoopStall()
        pool = WorkerPool("m", ["http://w1"], 100.0, 2, client=client, stall=stall)
        stall.start()
        await asyncio.sleep(0.15)
        entry = pool.workers["http://w1"]
        await pool.poll_once()
        await asyncio.sleep(0.15)
        assert entry.failures == 0
        block = False  # the same failure with the loop running counts
        await pool.poll_once()
        assert entry.failures == 1
        await stall.stop()
