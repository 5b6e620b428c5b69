"""PdWorker's per-step bookkeeping without an engine, a NIXL agent or a socket, on a fake
clock: which finished requests are reported as sent (their blocks freed), that ids of
requests that never held blocks are not kept for the life of the engine, and the stats
report the connector hands vLLM. (The connector's modules import vLLM; they are imported
when a test runs, so collecting the unit tests does not pay for vLLM and torch.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtransfer import leases
from kvtransfer.protocol import Release

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True

if TYPE_CHECKING:
    from kvtransfer.worker import PdWorker


def meta(**fields):
    from kvtransfer.scheduler import PdConnectorMetadata

    return PdConnectorMetadata(**fields)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_worker(clock: Clock) -> PdWorker:
    from kvtransfer.worker import PdWorker, WorkerConfig

    cfg = WorkerConfig(engine_id="eng-t", bind_endpoint="tcp://127.0.0.1:0", advertise_endpoint="tcp://127.0.0.1:0",
                       lease_seconds=10.0, read_timeout_s=5.0, handshake_timeout_s=2.0, transport="tcp", model="m",
                       dtype="bfloat16", kv_cache_dtype="auto", block_size=16, tp_size=1)
    return PdWorker(cfg, num_blocks=64, clock=clock)


def test_held_request_is_sent_once_released_and_finished():
    w = make_worker(Clock())
    w.start_load_kv(meta(holds={"r1": (3, 10.0)}))
    assert w.get_transfer_results({"r1"}) == (set(), set(), set())  # held: not freed yet
    assert w.holder.on_release(Release("r1", "eng-d", "")).status == "ok"
    sending, _, _ = w.get_transfer_results(set())
    assert sending == {"r1"}
    assert w.get_transfer_results(set())[0] == set()  # reported once
    assert w.stats.blocks_released == 3
    assert "r1" not in w.leases.finished_ids
    w.shutdown()


def test_lease_expiry_frees_after_the_lease():
    clock = Clock()
    w = make_worker(clock)
    w.start_load_kv(meta(holds={"r1": (2, 10.0)}))
    assert w.get_transfer_results({"r1"})[0] == set()
    clock.t += 9.0
    assert w.get_transfer_results(set())[0] == set()
    clock.t += 2.0
    assert w.get_transfer_results(set())[0] == {"r1"}
    assert w.stats.lease_expiries == 1
    w.shutdown()


def test_finished_ids_without_holds_are_forgotten():
    clock = Clock()
    w = make_worker(clock)
    w.start_load_kv(meta(holds={"held": (1, 1000.0)}))
    w.get_transfer_results({f"plain-{i}" for i in range(500)} | {"held"})
    assert len(w.leases.finished_ids) == 501  # kept for a grace period, in case a hold is late
    clock.t += leases.FINISHED_GRACE_S + 1
    w.get_transfer_results({"late"})
    assert w.leases.finished_ids == {"held", "late"}  # the held one stays until it is freed
    w.holder.on_release(Release("held", "eng-d", ""))
    assert w.get_transfer_results(set())[0] == {"held"}
    assert w.leases.finished_ids == {"late"}
    w.shutdown()


def test_stats_report_counts_holds_and_the_held_blocks_gauge():
    clock = Clock()
    w = make_worker(clock)
    assert w.take_stats() is None  # nothing happened yet: no report
    w.start_load_kv(meta(holds={"a": (2, 10.0), "b": (5, 10.0)}))
    w.get_transfer_results({"a", "b"})
    w.holder.on_release(Release("a", "eng-d", ""))
    w.get_transfer_results(set())
    report = w.take_stats()
    from kvtransfer.stats import PdKVStats

    assert isinstance(report, PdKVStats)
    r = report.reduce()
    assert (r["requests_held"], r["blocks_released"], r["held_blocks"], r["lease_expiries"]) == (2, 2, 5, 0)
    clock.t += 11.0
    w.get_transfer_results(set())
    r = w.take_stats().reduce()  # a new report: counters start again from zero
    assert (r["requests_held"], r["blocks_released"], r["held_blocks"], r["lease_expiries"]) == (0, 0, 0, 1)
    w.shutdown()


def test_holds_are_taken_when_the_step_is_bound_before_its_forward():
    """vLLM binds a step's metadata before the forward and calls start_load_kv after it (on a
    CPU, after it has run): a decode asking for a finished prefill's blocks during the next
    step's forward must find them held, not "pending" until its acquire gives up."""
    from kvtransfer.connector import PdConnector

    w = make_worker(Clock())
    c = PdConnector.__new__(PdConnector)  # the worker-role connector around `w`, without a VllmConfig
    c._worker, c._scheduler = w, None
    step = meta(holds={"r1": (4, 10.0)})
    assert w.leases.acquire("r1").status == "pending"
    c.bind_connector_metadata(step)
    assert w.leases.acquire("r1").status == "ok"  # during the forward
    c.start_load_kv(None)  # after it: the same step's holds are not taken twice
    assert w.stats.requests_held == 1
    assert w.get_transfer_results(set())[0] == set() and w.stats.held_blocks == 4
    w.shutdown()
