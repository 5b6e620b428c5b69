"""Block hashes and the prefix index: events applied, overlap counted, approximate expiry."""

import msgspec

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from router.hashing import block_hashes, chain
from router.index import PrefixIndex

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True

BS = 4


def test_hashes_are_chained_and_full_blocks_only():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2  # the partial block [9] is not hashed
    assert a[1] == chain(a[0], [5, 6, 7, 8])
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert b[1] != a[1]  # same tokens, different prefix -> different hash
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == a


def stored(hashes, parent, tokens):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS)


def test_events_store_chain_through_engine_hashes_and_remove():
    idx = PrefixIndex(BS)
    prompt = list(range(1, 13))  # 3 blocks
    ours = block_hashes(prompt, BS)
    idx.apply("w1", stored([b"e1", b"e2"], None, prompt[:8]))
    assert idx.overlap("w1", ours) == 2
    idx.apply("w1", stored([b"e3"], b"e2", prompt[8:12]))  # parent named by the engine's hash
    assert idx.overlap("w1", ours) == 3
    assert idx.overlap("w2", ours) == 0
    idx.apply("w1", BlockRemoved(block_hashes=[b"e2"]))
    assert idx.overlap("w1", ours) == 1  # the chain breaks at the removed block
    idx.apply("w1", AllBlocksCleared())
    assert idx.overlap("w1", ours) == 0 and idx.num_blocks() == 0


def test_stored_with_unknown_parent_is_ignored():
    idx = PrefixIndex(BS)
    idx.apply("w", stored([b"x"], b"never-seen", [1, 2, 3, 4]))
    assert idx.num_blocks() == 0


def test_wire_format_matches_vllm_kv_event_batch():
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    batch = KVEventBatch(ts=1.0, events=[VBlockStored(block_hashes=[b"h1"], parent_block_hash=None,
                                                       token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
                                                       medium="CPU", lora_name=None)])
    payload = msgspec.msgpack.encode(batch)
    ours = decode_batch(payload)
    assert isinstance(ours, EventBatch)
    ev = ours.events[0]
    assert isinstance(ev, BlockStored) and ev.token_ids == [1, 2, 3, 4] and ev.block_hashes == [b"h1"]


def test_approximate_mode_expires():
    now = [100.0]
    idx = PrefixIndex(BS, ttl_s=10, clock=lambda: now[0])
    h = block_hashes(list(range(8)), BS)
    idx.record_routed("w", h)
    assert idx.overlap("w", h) == 2
    now[0] += 9
    assert idx.overlap("w", h) == 2
    now[0] += 2
    assert idx.overlap("w", h) == 0
    idx.expire()
    assert idx.num_blocks() == 0


def test_overlaps_for_all_workers_in_one_walk_agree_with_per_worker_overlap():
    import random

    rng = random.Random(5)
    idx = PrefixIndex(BS, ttl_s=1e9)
    base = [rng.randrange(100) for _ in range(40)]
    h = block_hashes(base, BS)
    for w, n in (("a", 10), ("b", 3), ("c", 0), ("d", 7)):
        idx.record_routed(w, h[:n])
    idx.record_routed("e", h[2:9])  # holds later blocks but not the first: no leading overlap
    got = idx.overlaps(h)
    assert got == {"a": 10, "b": 3, "d": 7}
    assert all(idx.overlap(w, h) == got.get(w, 0) for w in "abcde")
    idx.remove_worker("a")
    assert idx.overlaps(h) == {"b": 3, "d": 7}
