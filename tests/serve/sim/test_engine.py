"""The simulated engine's scheduler, on virtual time (no sockets, no real sleeps)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from serve import protocol as p
from serve.sim.blocks import BlockTable
from serve.sim.engine import SimConfig, SimEngine
from serve.sim.timing import ConstantStep
from serve.sim.tokens import Vocabulary, request_key, token_at

VOCAB = Vocabulary(tuple(range(100, 200)), eos_id=None, size=256)


class VirtualTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += s
        await asyncio.sleep(0)


def engine(vt: VirtualTime, **cfg) -> SimEngine:
    c = dataclasses.replace(SimConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=512), **cfg)
    return SimEngine(c, VOCAB, ConstantStep(0.01), BlockTable(c.num_blocks, c.block_size, c.enable_prefix_caching),
                     clock=vt.clock, sleep=vt.sleep)


def greedy(n: int) -> p.SamplingOptions:
    return p.SamplingOptions(max_tokens=n, temperature=0.0)


async def drain(req) -> list[p.TokenDelta]:
    out = []
    while True:
        d = await req.deltas.get()
        out.append(d)
        if d.finished:
            return out


def run(coro):
    return asyncio.run(coro)


def test_tokens_stream_one_per_step_and_finish_by_length():
    async def go():
        vt = VirtualTime()
        e = engine(vt)
        e.start()
        req = e.add("a", list(range(10)), greedy(5))
        deltas = await drain(req)
        await e.stop()
        return vt, e, deltas

    vt, e, deltas = run(go())
    key = request_key(list(range(10)), greedy(5))
    assert [d.token_ids[0] for d in deltas] == [token_at(key, i, VOCAB, greedy(5)) for i in range(5)]
    assert deltas[-1].finish_reason == "length" and deltas[0].num_prompt_tokens == 10
    assert e.counters.steps == 5 and vt.now == pytest.approx(0.05)  # one prefill step, then four decodes
    assert e.table.used_blocks == 0  # freed when finished


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    async def go():
        vt = VirtualTime()
        e = engine(vt)
        e.start()
        req = e.add("a", list(range(100)), greedy(1))  # 100 tokens, 32 a step: 4 prefill steps
        await drain(req)
        await e.stop()
        return e

    assert run(go()).counters.steps == 4


def test_without_chunked_prefill_a_prompt_over_the_budget_is_refused():
    e = engine(VirtualTime(), enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        e.add("a", list(range(100)), greedy(1))
    with pytest.raises(ValueError, match="max_model_len"):
        e.add("b", [1], greedy(600))


def test_batch_cap_queues_the_rest():
    async def go():
        vt = VirtualTime()
        e = engine(vt, max_num_seqs=2)
        e.start()
        reqs = [e.add(str(i), [i] * 4, greedy(20)) for i in range(4)]
        await asyncio.sleep(0)
        await vt.sleep(0)
        for _ in range(3):
            await asyncio.sleep(0)
        seen = (e.num_running, e.num_waiting)
        await asyncio.gather(*(drain(r) for r in reqs))
        await e.stop()
        return seen

    running, waiting = run(go())
    assert running == 2 and waiting == 2


def test_preemption_when_blocks_run_out_keeps_the_output():
    async def go():
        vt = VirtualTime()
        e = engine(vt, num_blocks=6, max_num_seqs=2)
        e.start()
        a = e.add("a", list(range(8)), greedy(12))  # grows to 20 tokens: 5 blocks
        b = e.add("b", list(range(50, 58)), greedy(12))
        da, db = await asyncio.gather(drain(a), drain(b))
        await e.stop()
        return e, da, db

    e, da, db = run(go())
    assert e.counters.preemptions >= 1
    for prompt, deltas in ((list(range(8)), da), (list(range(50, 58)), db)):
        key = request_key(prompt, greedy(12))
        assert [d.token_ids[0] for d in deltas] == [token_at(key, i, VOCAB, greedy(12)) for i in range(12)]


def test_abort_frees_blocks_and_ends_the_stream():
    async def go():
        vt = VirtualTime()
        e = engine(vt)
        e.start()
        req = e.add("a", list(range(10)), greedy(200))  # 210 tokens of the 256 the cache holds
        await req.deltas.get()
        assert e.table.used_blocks > 0
        assert e.abort("a") and not e.abort("a")
        deltas = await drain(req)
        await e.stop()
        return e, deltas

    e, deltas = run(go())
    assert deltas[-1].finish_reason == "abort" and e.table.used_blocks == 0


def test_a_held_request_keeps_its_blocks_until_released():
    async def go():
        vt = VirtualTime()
        e = engine(vt)
        held = []
        e.on_finished = lambda req: held.append(req.request_id)  # returns None: no transfer params
        e.start()
        req = e.add("a", list(range(10)), greedy(1), hold=True)
        await drain(req)
        used = e.table.used_blocks
        e.table.free("a")
        await e.stop()
        return held, used, e.table.used_blocks

    held, used, after = run(go())
    assert held == ["a"] and used == 3 and after == 0


def test_a_remote_load_skips_the_prompt_but_its_last_token():
    async def go():
        vt = VirtualTime()
        e = engine(vt)
        e.start()
        req = e.add("a", list(range(40)), greedy(2), loading=True)
        await asyncio.sleep(0)
        assert e.counters.steps == 0  # waits for its KV
        e.load_done(req, ok=True)
        deltas = await drain(req)
        await e.stop()
        return e, deltas

    e, deltas = run(go())
    assert e.counters.prompt_external == 39 and e.counters.prompt_local_compute == 1
    assert deltas[0].num_cached_tokens == 39 and e.counters.steps == 2


def test_a_request_whose_kv_arrived_runs_though_the_head_of_the_queue_finds_no_room():
    """The head of the waiting queue needs blocks that the requests whose KV already arrived
    hold; those must still run (or both wait for each other forever: a decode worker full of
    loaded requests, as a scenario with long documents found)."""
    vt = VirtualTime()
    e = engine(vt, num_blocks=12)  # 48 tokens of KV
    head = e.add("head", list(range(40)), greedy(2))  # 10 blocks: will not fit beside the loaded one
    loaded = e.add("loaded", list(range(100, 120)), greedy(2), loading=True)
    e.load_done(loaded, ok=True)  # its 20 tokens' blocks are allocated now (5 blocks)
    batch = e.schedule()
    assert [r.request_id for r, _ in batch] == ["loaded"]
    assert head in e.waiting and not head.allocated


def test_a_failed_remote_load_computes_the_prompt_locally():
    async def go():
        vt = VirtualTime()
        e = engine(vt)
        e.start()
        req = e.add("a", list(range(40)), greedy(2), loading=True)
        e.load_done(req, ok=False)
        deltas = await drain(req)
        await e.stop()
        return e, deltas

    e, deltas = run(go())
    assert e.counters.prompt_external == 0 and e.counters.prompt_local_compute == 40
    assert [d.token_ids[0] for d in deltas] == [token_at(request_key(list(range(40)), greedy(2)), i, VOCAB,
                                                         greedy(2)) for i in range(2)]


def test_a_request_the_cache_could_never_hold_is_refused_not_left_waiting():
    e = engine(VirtualTime(), num_blocks=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="more KV blocks than the cache holds"):
        e.add("a", list(range(10)), greedy(10))
    e.add("b", list(range(10)), greedy(6))  # fits exactly
