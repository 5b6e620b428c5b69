"""vLLM's KV cache events as they arrive on the wire, decoded without importing vLLM.

A worker's ZMQ publisher sends (topic, sequence, payload) where payload is a msgpack
`EventBatch` [ts, events, dp_rank]; each event is a map tagged by `type`: BlockStored
(vLLM's block hashes, its parent's hash, and the token ids of the stored blocks),
BlockRemoved (vLLM's hashes) or AllBlocksCleared. Unknown fields are ignored.
"""

from __future__ import annotations

import msgspec

EngineHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    return _decoder.decode(payload)
