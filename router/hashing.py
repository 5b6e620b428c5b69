"""The one block-hash function shared by the router, the workers' KV events and the tests.

Each full block of `block_size` token ids gets a chained hash: the hash of its parent
block's hash followed by its tokens, so equal hashes mean equal prefixes. Only full
blocks are hashed (engines cache only full blocks). The router computes this from the
token ids that vLLM's BlockStored events carry, so it never needs vLLM's hash seed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT = 0


def chain(parent: int, tokens: Sequence[int]) -> int:
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("I", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is ignored);
    `chain` block by block, over one conversion of the whole prompt (the router's hot path)."""
    out: list[int] = []
    full = len(token_ids) // block_size
    if not full:
        return out
    packed = array("I", token_ids[:full * block_size])
    data = memoryview(packed.tobytes())
    step = packed.itemsize * block_size
    for start in range(0, full * step, step):
        h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(data[start:start + step])
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out
