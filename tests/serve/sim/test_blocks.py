"""The simulated engine's block table, without sockets or a clock."""

import pytest

from router.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.hashing import block_hashes
from router.index import PrefixIndex
from serve.sim.blocks import BlockTable, NoSpace


def table(n=8, bs=4, caching=True):
    events = []
    return BlockTable(n, bs, caching, on_event=events.append), events


def test_allocate_counts_blocks_and_usage():
    t, _ = table()
    assert t.allocate("a", list(range(10))) == 0  # 10 tokens: 3 blocks of 4
    assert t.used_blocks == 3 and t.usage == pytest.approx(3 / 8)
    t.free("a")
    assert t.used_blocks == 0 and t.available == 8


def test_prefix_cache_hits_full_blocks_with_the_routers_hashes():
    t, events = table()
    prompt = list(range(12))
    t.allocate("a", prompt)
    t.commit("a", prompt)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == block_hashes(prompt, 4)
    # The router's own index, fed these events, sees the same blocks.
    index = PrefixIndex(4)
    for e in events:
        index.apply("w", e)
    assert index.overlap("w", block_hashes(prompt, 4)) == 3
    t.free("a")
    # A new request with the same first 8 tokens reuses 2 blocks (the last token is always computed).
    assert t.allocate("b", prompt[:8] + [99, 98, 97]) == 8
    assert t.used_blocks == 3


def test_whole_prompt_cached_still_computes_its_last_block():
    t, _ = table()
    prompt = list(range(8))
    t.allocate("a", prompt)
    t.commit("a", prompt)
    t.free("a")
    assert t.allocate("b", prompt) == 4  # not 8: vLLM never serves the whole prompt from cache


def test_lru_eviction_reports_removed_blocks():
    t, events = table(n=4)
    for rid, base in (("a", 0), ("b", 100)):
        p = list(range(base, base + 8))
        t.allocate(rid, p)
        t.commit(rid, p)
        t.free(rid)
    assert t.available == 4 and t.used_blocks == 0
    t.allocate("c", list(range(200, 208)))  # needs 2: evicts a's blocks (the oldest)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(removed) == set(block_hashes(list(range(8)), 4))
    assert t.cached_prefix(list(range(100, 109))) != []  # b's blocks survived


def test_no_space_and_abort_frees():
    t, _ = table(n=2)
    t.allocate("a", list(range(8)))
    with pytest.raises(NoSpace):
        t.allocate("b", [1])
    t.free("a")  # an abort frees at once
    t.allocate("b", [1])


def test_grow_for_decode_and_refuse_past_capacity():
    t, _ = table(n=3)
    t.allocate("a", list(range(4)))
    t.grow("a", 5)
    assert len(t.blocks_of("a")) == 2
    assert t.can_grow("a", 12) and not t.can_grow("a", 13)
    with pytest.raises(NoSpace):
        t.grow("a", 13)


def test_shared_blocks_are_counted_once_and_freed_last():
    t, _ = table()
    p = list(range(8))
    t.allocate("a", p + [50])
    t.commit("a", p + [50])
    t.allocate("b", p + [60])  # shares a's two full blocks
    assert t.used_blocks == 4
    t.free("a")
    assert t.used_blocks == 3  # b still holds the shared prefix
    t.free("b")
    assert t.used_blocks == 0


def test_prefix_caching_off_caches_nothing():
    t, events = table(caching=False)
    p = list(range(8))
    t.allocate("a", p)
    t.commit("a", p)
    t.free("a")
    assert t.allocate("b", p) == 0 and not events


def test_reset_drops_unreferenced_cache():
    t, events = table()
    p = list(range(8))
    t.allocate("a", p)
    t.commit("a", p)
    t.free("a")
    assert t.reset()
    assert isinstance(events[-1], AllBlocksCleared)
    assert t.allocate("b", p) == 0
