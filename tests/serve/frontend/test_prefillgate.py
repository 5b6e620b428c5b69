"""The prefill gate (serve.frontend.prefillgate) on its own: room per worker, oldest first,
timeouts, workers joining, and a grant that races a cancel. No I/O."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from router.load import LoadTracker
from serve.frontend.prefillgate import POLL_S, PrefillGate


@dataclass
class W:
    url: str


@dataclass
class P:
    prefill: W | None
    prompt_blocks: int = 2
    tag: str = field(default="")


def setup(cap: int, *urls: str) -> tuple[PrefillGate, LoadTracker, list[W]]:
    load, workers = LoadTracker(), [W(u) for u in urls]
    return PrefillGate(cap, load, lambda: workers), load, workers


def done(gate: PrefillGate, load: LoadTracker, plan: P) -> None:
    """What the frontend does when a prefill ends."""
    load.release(plan.prefill.url, "prefill", plan.prompt_blocks)
    gate.kick()


def test_the_router_s_choice_while_it_has_room_then_the_least_loaded_then_wait():
    async def go():
        gate, load, (a, b) = setup(2, "a", "b")
        got = [await gate.admit(P(a), 1.0) for _ in range(3)]
        assert [g.prefill.url for g in got] == ["a", "a", "b"]  # a's room first, then b
        assert load.requests("a", "prefill") == 2 and load.blocks("a", "prefill") == 4
        got.append(await gate.admit(P(b), 1.0))
        assert got[-1].prefill.url == "b"
        waiter = asyncio.create_task(gate.admit(P(a, tag="late"), 5.0))
        await asyncio.sleep(0.01)
        assert gate.held == 1 and not waiter.done()
        done(gate, load, got[2])  # b finishes one: the waiter takes b, not its router's choice a
        plan = await asyncio.wait_for(waiter, 1.0)
        assert plan.prefill.url == "b" and plan.tag == "late" and gate.held == 0
        assert load.requests("b", "prefill") == 2

    asyncio.run(go())


def test_waiters_are_admitted_oldest_first_and_newcomers_queue_behind_them():
    async def go():
        gate, load, (a,) = setup(1, "a")
        first = await gate.admit(P(a), 1.0)
        order: list[str] = []

        async def wait(tag: str) -> P:
            plan = await gate.admit(P(a, tag=tag), 5.0)
            order.append(tag)
            return plan

        tasks = [asyncio.create_task(wait(t)) for t in ("w1", "w2", "w3")]
        await asyncio.sleep(0.01)
        assert gate.held == 3
        prev = first
        for t in tasks:
            done(gate, load, prev)
            prev = await asyncio.wait_for(t, 1.0)
        assert order == ["w1", "w2", "w3"] and load.requests("a", "prefill") == 1

    asyncio.run(go())


def test_a_waiter_times_out_with_nothing_reserved():
    async def go():
        gate, load, (a,) = setup(1, "a")
        await gate.admit(P(a), 1.0)
        assert await gate.admit(P(a), 0.05) is None
        assert gate.held == 0 and load.requests("a", "prefill") == 1

    asyncio.run(go())


def test_a_worker_that_joins_takes_the_waiters():
    async def go():
        gate, load, workers = setup(1, "a")
        await gate.admit(P(workers[0]), 1.0)
        waiters = [asyncio.create_task(gate.admit(P(workers[0]), 5.0)) for _ in range(2)]
        await asyncio.sleep(0.01)
        workers += [W("b"), W("c")]  # nothing finishes: only the gate's own poll can notice them
        plans = await asyncio.wait_for(asyncio.gather(*waiters), POLL_S * 40)  # generous: a loaded host
        assert sorted(p.prefill.url for p in plans) == ["b", "c"] and gate.held == 0

    asyncio.run(go())


def test_no_prefill_worker_at_all_waits_for_one():
    async def go():
        gate, _, workers = setup(1)
        waiter = asyncio.create_task(gate.admit(P(None), 5.0))
        await asyncio.sleep(0.01)
        assert gate.held == 1
        workers.append(W("a"))
        assert (await asyncio.wait_for(waiter, POLL_S * 40)).prefill.url == "a"  # generous bound: a loaded host

    asyncio.run(go())


def test_a_grant_that_races_a_cancel_is_handed_back():
    async def go():
        gate, load, (a,) = setup(1, "a")
        first = await gate.admit(P(a), 1.0)
        waiter = asyncio.create_task(gate.admit(P(a), 5.0))
        await asyncio.sleep(0.01)
        done(gate, load, first)  # granted to the waiter (load reserved) ...
        assert load.requests("a", "prefill") == 1
        waiter.cancel()  # ... which is cancelled before it runs again (its client left)
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert load.requests("a", "prefill") == 0 and gate.held == 0

    asyncio.run(go())


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="cap >= 1"):
        PrefillGate(0, LoadTracker(), list)
