"""The simulated engine's KV block table: capacity, a prefix cache, LRU eviction.

Blocks are ids 0..num_blocks-1. A request holds a list of blocks for its tokens; a full
block whose tokens are known gets the chained hash of `router.hashing` (the hash the
router computes from KV events, so the simulated worker publishes exactly what the router
indexes). With prefix caching on, a new request reuses the cached blocks of its prompt's
longest cached prefix. A block no request holds stays cached (evictable, least recently
used first) until its space is needed. Every change the router should know of is reported
through `on_event` as vLLM's event types (router.events): BlockStored, BlockRemoved,
AllBlocksCleared. Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from router.hashing import ROOT, block_hashes, chain


class NoSpace(Exception):
    """Not enough free or evictable blocks."""


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of its leading full blocks, registered in the cache
    tokens: int = 0  # tokens its blocks hold


class BlockTable:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 on_event: Callable[[Event], None] | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.on_event = on_event
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest id
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}  # block -> chained hash (cached blocks only)
        self._block_of: dict[int, int] = {}  # chained hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._seqs: dict[str, _Seq] = {}

    # -- queries ----------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks some request holds."""
        return len(self._refs)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def available(self) -> int:
        """Blocks that can be handed out: free plus evictable."""
        return len(self._free) + len(self._evictable)

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._seqs[request_id].blocks)

    def committed(self, request_id: str) -> int:
        """Blocks of the request registered in the prefix cache (by `commit`/`commit_next`)."""
        return len(self._seqs[request_id].hashes)

    def holds(self, request_id: str) -> bool:
        return request_id in self._seqs

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of `token_ids` (full blocks only)."""
        if not self.prefix_caching:
            return []
        out, parent = [], ROOT
        bs = self.block_size
        # The last token is always computed (vLLM never serves a whole prompt from cache).
        for start in range(0, len(token_ids) - bs, bs):
            parent = chain(parent, token_ids[start:start + bs])
            block = self._block_of.get(parent)
            if block is None:
                break
            out.append(block)
        return out

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # -- changes ----------------------------------------------------------------------
    def allocate(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Blocks for a new request's prompt; returns how many prompt tokens were cached."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id} already holds blocks")
        hit = self.cached_prefix(token_ids)
        need = self.blocks_needed(len(token_ids)) - len(hit)
        reusable = sum(1 for b in hit if b in self._evictable)
        if need > self.available - reusable:
            raise NoSpace(f"{need} blocks needed, {self.available - reusable} available")
        seq = _Seq()
        for b in hit:
            self._ref(b)
            seq.blocks.append(b)
            seq.hashes.append(self._hash_of[b])
        for _ in range(need):
            seq.blocks.append(self._take())
        seq.tokens = len(token_ids)
        self._seqs[request_id] = seq
        return len(hit) * self.block_size

    def grow(self, request_id: str, n_tokens: int) -> None:
        """Room for the request to hold `n_tokens` tokens in all (decode appends)."""
        seq = self._seqs[request_id]
        need = self.blocks_needed(n_tokens) - len(seq.blocks)
        if need > self.available:
            raise NoSpace(f"{need} blocks needed, {self.available} available")
        for _ in range(max(0, need)):
            seq.blocks.append(self._take())
        seq.tokens = max(seq.tokens, n_tokens)

    def try_grow(self, request_id: str, n_tokens: int) -> bool:
        """`grow` if there is room (True), else nothing (False): a decode step's one call."""
        seq = self._seqs[request_id]
        have = len(seq.blocks)
        if n_tokens <= have * self.block_size:  # the common case: room in its last block
            if n_tokens > seq.tokens:
                seq.tokens = n_tokens
            return True
        need = -(-n_tokens // self.block_size) - have
        if need > len(self._free) + len(self._evictable):
            return False
        for _ in range(need):
            seq.blocks.append(self._take())
        seq.tokens = n_tokens
        return True

    def can_grow(self, request_id: str, n_tokens: int) -> bool:
        return self.blocks_needed(n_tokens) - len(self._seqs[request_id].blocks) <= self.available

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Register the request's full blocks of `token_ids` (computed now) in the prefix cache."""
        seq = self._seqs[request_id]
        bs = self.block_size
        first, full = len(seq.hashes), min(len(token_ids) // bs, len(seq.blocks))
        if full <= first:
            return
        tokens = token_ids[first * bs:full * bs]
        parent = seq.hashes[-1] if seq.hashes else ROOT
        hashes = block_hashes(tokens, bs, parent)  # one pass over the tokens, not one per block
        new = [i for i, h in enumerate(hashes) if self._add_hash(seq, h)]
        if self.on_event is None:
            return
        start = 0  # one BlockStored per run of blocks new to this cache (vLLM batches them too)
        for k in range(1, len(new) + 1):
            if k == len(new) or new[k] != new[k - 1] + 1:
                i, j = new[start], new[k - 1] + 1
                prev = hashes[i - 1] if i else parent
                self.on_event(BlockStored(block_hashes=hashes[i:j], parent_block_hash=None if prev == ROOT else prev,
                                          token_ids=list(tokens[i * bs:j * bs]), block_size=bs))
                start = k

    def commit_next(self, request_id: str, block_tokens: Sequence[int]) -> None:
        """Register the request's next full block, whose tokens are `block_tokens` (the same
        as `commit` of its whole context, without re-reading the blocks before it)."""
        seq = self._seqs[request_id]
        if len(block_tokens) != self.block_size or len(seq.hashes) >= len(seq.blocks):
            raise ValueError("commit_next: one full block the request holds")
        self._register(seq, block_tokens)

    def _register(self, seq: _Seq, tokens: Sequence[int]) -> None:
        parent = seq.hashes[-1] if seq.hashes else ROOT
        h = chain(parent, tokens)
        if self._add_hash(seq, h) and self.on_event is not None:
            self.on_event(BlockStored(block_hashes=[h], parent_block_hash=None if parent == ROOT else parent,
                                      token_ids=list(tokens), block_size=self.block_size))

    def _add_hash(self, seq: _Seq, h: int) -> bool:
        """The request's next block gets hash `h`; True if the cache learnt a new prefix (a
        twin block may hold it already)."""
        block = seq.blocks[len(seq.hashes)]
        seq.hashes.append(h)
        if self.prefix_caching and h not in self._block_of:
            self._hash_of[block] = h
            self._block_of[h] = block
            return True
        return False

    def free(self, request_id: str) -> None:
        """The request is done (finished, aborted, or its hold ended): drop its references."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        for b in reversed(seq.blocks):  # tail blocks are evicted before the shared prefix
            self._unref(b)

    def reset(self) -> bool:
        """Drop every cached block no request holds (vLLM's reset_prefix_cache)."""
        for b in list(self._evictable):
            self._forget(b, report=False)
            self._free.append(b)
        self._evictable.clear()
        if self.on_event is not None:
            self.on_event(AllBlocksCleared())
        return True

    # -- internals --------------------------------------------------------------------
    def _ref(self, b: int) -> None:
        self._evictable.pop(b, None)
        self._refs[b] = self._refs.get(b, 0) + 1

    def _unref(self, b: int) -> None:
        n = self._refs[b] - 1
        if n:
            self._refs[b] = n
            return
        del self._refs[b]
        if b in self._hash_of:
            self._evictable[b] = None
        else:
            self._free.append(b)

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._forget(b, report=True)
        self._refs[b] = 1
        return b

    def _forget(self, b: int, report: bool) -> None:
        h = self._hash_of.pop(b, None)
        if h is not None:
            self._block_of.pop(h, None)
            if report and self.on_event is not None:
                self.on_event(BlockRemoved(block_hashes=[h]))
