"""Worker-side hold bookkeeping without an engine or NIXL agent: which finished requests are
reported as sent (their blocks freed), and that ids of requests that never held blocks are
not kept for the life of the engine."""

from kvtransfer import worker as kvworker
from kvtransfer.scheduler import PdConnectorMetadata
from kvtransfer.worker import PdWorker, WorkerConfig


def make_worker() -> PdWorker:
    cfg = WorkerConfig(engine_id="eng-t", bind_endpoint="tcp://127.0.0.1:0", advertise_endpoint="tcp://127.0.0.1:0", lease_seconds=10.0,
                       read_timeout_s=5.0, handshake_timeout_s=2.0, transport="tcp", model="m", dtype="bfloat16",
                       kv_cache_dtype="auto", block_size=16, tp_size=1)
    return PdWorker(cfg, num_blocks=64)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_held_request_is_sent_once_released_and_finished(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(kvworker.time, "monotonic", clock)
    w = make_worker()
    w.start_load_kv(PdConnectorMetadata(holds={"r1": (3, 10.0)}))
    assert w.get_transfer_results({"r1"}) == (set(), set(), set())  # held: not freed yet
    w._on_release(kvworker.Release("r1", "eng-d", ""))
    sending, _, _ = w.get_transfer_results(set())
    assert sending == {"r1"}
    assert w.stats.data["blocks_released"] == 3
    assert "r1" not in w._finished_seen
    w.shutdown()


def test_lease_expiry_frees_after_the_lease(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(kvworker.time, "monotonic", clock)
    w = make_worker()
    w.start_load_kv(PdConnectorMetadata(holds={"r1": (2, 10.0)}))
    assert w.get_transfer_results({"r1"})[0] == set()
    clock.t += 9.0
    assert w.get_transfer_results(set())[0] == set()
    clock.t += 2.0
    assert w.get_transfer_results(set())[0] == {"r1"}
    assert w.stats.data["lease_expiries"] == 1
    w.shutdown()


def test_finished_ids_without_holds_are_forgotten(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(kvworker.time, "monotonic", clock)
    w = make_worker()
    w.start_load_kv(PdConnectorMetadata(holds={"held": (1, 1000.0)}))
    w.get_transfer_results({f"plain-{i}" for i in range(500)} | {"held"})
    assert len(w._finished_seen) == 501  # kept for a grace period, in case a hold is late
    clock.t += kvworker.FINISHED_GRACE_S + 1
    w.get_transfer_results({"late"})
    assert set(w._finished_seen) == {"held", "late"}  # the held one stays until it is freed
    w._on_release(kvworker.Release("held", "eng-d", ""))
    assert w.get_transfer_results(set())[0] == {"held"}
    assert set(w._finished_seen) == {"late"}
    w.shutdown()
