"""Scheduler side decisions, with stand-in requests (no engine).

vLLM is imported when a test runs, not when the module is collected: collecting the unit
tests (in every xdist worker) does not pay for importing vLLM and torch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from kvtransfer.protocol import TransferParams, from_vllm_params, remote_decode_request, to_vllm_params

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True

if TYPE_CHECKING:
    from kvtransfer.scheduler import PdScheduler

BS = 128


def status(name: str):
    from vllm.v1.request import RequestStatus

    return RequestStatus[name]


def sched() -> PdScheduler:
    from kvtransfer.scheduler import PdScheduler

    return PdScheduler("eng-p", "tcp://127.0.0.1:5555", BS, lease_seconds=7.0)


def req(rid="r1", params=None, prompt=300, computed=0, state=None):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=prompt,
                           num_computed_tokens=computed, status=state if state is not None else status("RUNNING"))


class Blocks:
    """Stand-in for vLLM's KVCacheBlocks: `cached` prefix-cache hits, then new blocks."""

    def __init__(self, unhashed, cached=0):
        self.unhashed = unhashed
        self.blocks = ([SimpleNamespace(block_id=900 + i, block_hash=b"h", is_null=False) for i in range(cached)]
                       + [SimpleNamespace(block_id=b, block_hash=None, is_null=False) for b in unhashed],)

    def get_unhashed_block_ids_all_groups(self):
        return [self.unhashed]


def remote(blocks=(10, 11, 12), tokens=300) -> TransferParams:
    return TransferParams(engine_id="eng-p", request_id="p-r1", block_ids=list(blocks), num_tokens=tokens,
                          side_channel="tcp://127.0.0.1:5555", lease_seconds=7.0)


def test_prefill_finish_holds_blocks_and_returns_params():
    s = sched()
    r = req(params=remote_decode_request(), state=status("FINISHED_LENGTH_CAPPED"))
    delay, params = s.request_finished(r, ([4, 5, 6],))
    assert delay is True
    p = from_vllm_params(params)
    assert p.block_ids == [4, 5, 6] and p.num_tokens == 300 and p.engine_id == "eng-p"
    assert p.side_channel == "tcp://127.0.0.1:5555" and p.lease_seconds == 7.0
    meta = s.build_connector_meta()
    assert meta.holds == {"r1": (3, 7.0)}
    assert s.build_connector_meta().holds == {}  # reported once


def test_aborted_prefill_frees_at_once():
    s = sched()
    r = req(params=remote_decode_request(), state=status("FINISHED_ABORTED"))
    assert s.request_finished(r, ([4, 5],)) == (False, None)
    assert s.build_connector_meta().holds == {}


def test_plain_request_is_untouched():
    s = sched()
    assert s.get_num_new_matched_tokens(req(), 0) == (0, False)
    assert s.request_finished(req(state=status("FINISHED_STOPPED")), ([1],)) == (False, None)


def test_decode_reads_uncached_blocks_only():
    s = sched()
    r = req(params=to_vllm_params(remote()), prompt=300, computed=0)  # vLLM sets computed tokens later
    assert s.get_num_new_matched_tokens(r, 128) == (172, True)  # first block cached locally
    s.update_state_after_alloc(r, Blocks([40, 41], cached=1), 172)
    meta = s.build_connector_meta()
    assert len(meta.loads) == 1
    load = meta.loads[0]
    assert load.local_block_ids == [40, 41] and load.remote_block_ids == [11, 12]
    # One read per request: asked again (e.g. after the load), nothing more to load.
    assert s.get_num_new_matched_tokens(r, 300) == (0, False)


def test_full_local_hit_releases_remote_without_reading():
    s = sched()
    r = req(params=to_vllm_params(remote()), prompt=300, computed=300)
    assert s.get_num_new_matched_tokens(r, 300) == (0, False)
    s.update_state_after_alloc(r, Blocks([]), 0)
    meta = s.build_connector_meta()
    assert meta.loads == [] and [p.request_id for p in meta.releases] == ["p-r1"]


def test_decode_aborted_before_its_read_releases_the_prefill_side():
    s = sched()
    r = req(params=to_vllm_params(remote()))
    s.get_num_new_matched_tokens(r, 0)
    r.status = status("FINISHED_ABORTED")
    assert s.request_finished(r, ([],)) == (False, None)
    assert [p.request_id for p in s.build_connector_meta().releases] == ["p-r1"]
