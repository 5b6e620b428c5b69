"""Scheduler side of PdConnector: decides what moves. No memory is touched here.

Prefill engine: a request marked `do_remote_decode` finishes after its prefill; its
blocks are not freed (`request_finished` returns True) but held under a lease by the
worker side, and the returned transfer params tell the decode side where they are. An
aborted request's blocks are freed at once.

Decode engine: a request carrying remote params reports its uncached prompt tokens as
loadable asynchronously; once vLLM has allocated local blocks, the blocks to read (remote
ids past the local prefix-cache hit, paired with the new local ids) go to the worker side
in the step's metadata. A request that needs no read, or that ends before its read was
scheduled, still sends a release so the prefill side frees at once instead of at lease end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtransfer.errors import SettingsError
from kvtransfer.protocol import (LoadSpec, TransferParams, from_vllm_params, requested_mode, to_vllm_params,
                                 wants_remote_decode)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("vllm.pdserve.kvtransfer.scheduler")


@dataclass
class PdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    holds: dict[str, tuple[int, float]] = field(default_factory=dict)  # request -> (blocks, lease s)
    releases: list[TransferParams] = field(default_factory=list)  # remote holds to free unread
    idle: bool = False  # the step computes nothing: it may wait for a transfer instead of spinning


class PdScheduler:
    def __init__(self, engine_id: str, side_channel: str, block_size: int, lease_seconds: float) -> None:
        self.engine_id = engine_id
        self.side_channel = side_channel
        self.block_size = block_size
        self.lease_seconds = lease_seconds
        self._loads: list[LoadSpec] = []
        self._holds: dict[str, tuple[int, float]] = {}
        self._releases: list[TransferParams] = []
        self._awaiting: dict[str, TransferParams] = {}  # decode requests whose read is not yet planned
        self._planned: set[str] = set()  # decode requests whose read is planned (one read each)

    # -- decode side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        remote = from_vllm_params(request.kv_transfer_params)
        if remote is None or request.request_id in self._planned:
            return 0, False
        self._awaiting[request.request_id] = remote
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        remote = self._awaiting.pop(request.request_id, None)
        if remote is None:
            return
        self._planned.add(request.request_id)
        if num_external_tokens == 0:
            # Everything is in the local prefix cache: nothing to read, free the remote now.
            self._releases.append(remote)
            return
        local_ids = blocks.get_unhashed_block_ids_all_groups()[0]
        # Blocks served by the local prefix cache come first and carry a hash; the remote
        # blocks to read start after them. (request.num_computed_tokens is not set yet here.)
        first = sum(1 for b in blocks.blocks[0] if b.block_hash is not None and not b.is_null)
        remote_ids = remote.block_ids[first:first + len(local_ids)]
        if len(remote_ids) != len(local_ids):
            log.warning("request %s: %d local blocks but %d remote blocks; reading what matches",
                        request.request_id, len(local_ids), len(remote_ids))
            local_ids = local_ids[:len(remote_ids)]
        try:
            mode = requested_mode(request.kv_transfer_params)
        except SettingsError as exc:
            log.warning("request %s: %s; using the engine's mode", request.request_id, exc)
            mode = None
        self._loads.append(LoadSpec(request.request_id, remote, list(local_ids), list(remote_ids), mode))

    # -- prefill side -------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...] | list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._planned.discard(rid)
        remote = self._awaiting.pop(rid, None)
        if remote is not None:
            # Finished (aborted) before its read was planned: free the prefill side's blocks.
            self._releases.append(remote)
        if not wants_remote_decode(request.kv_transfer_params):
            return False, None
        ids = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) or not ids:
            return False, None  # aborted: free now
        self._holds[rid] = (len(ids), self.lease_seconds)
        params = TransferParams(engine_id=self.engine_id, request_id=rid, block_ids=ids,
                                num_tokens=request.num_prompt_tokens, side_channel=self.side_channel,
                                lease_seconds=self.lease_seconds)
        return True, to_vllm_params(params)

    def build_connector_meta(self, idle: bool = False) -> PdConnectorMetadata:
        meta = PdConnectorMetadata(loads=self._loads, holds=self._holds, releases=self._releases, idle=idle)
        self._loads, self._holds, self._releases = [], {}, []
        return meta
