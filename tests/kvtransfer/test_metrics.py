"""KvStats (what vLLM carries between processes) and KvMetrics (the pdserve_kv_* metrics)."""

import subprocess
import sys

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtransfer.errors import SettingsError
from kvtransfer.metrics import COUNTERS, TRANSFER_BUCKETS, KvMetrics, KvStats

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True


def sample(**kw) -> KvStats:
    base = dict(reads=2, blocks_read=10, bytes_read=4000, failures=1, lease_expiries=1, recomputes=1,
                releases_sent=3, blocks_released=8, requests_held=4, read_seconds=[0.001, 0.003],
                read_bytes=[1000, 3000], held_blocks=6)
    base.update(kw)
    return KvStats(**base)


def test_counters_are_the_fields_in_order():
    assert KvStats.__struct_fields__ == (*COUNTERS, "read_seconds", "read_bytes", "held_blocks")


def test_empty():
    assert KvStats().is_empty()
    assert not KvStats(held_blocks=0).is_empty()  # a gauge of 0 is a report
    assert not KvStats(read_seconds=[0.1]).is_empty()
    assert not KvStats(releases_sent=1).is_empty()


def test_aggregate_adds_counters_and_keeps_the_latest_gauge():
    a, b = sample(), sample(reads=1, read_seconds=[0.5], read_bytes=[7], held_blocks=None)
    c = a.aggregate(b)
    assert c.reads == 3 and c.bytes_read == 8000 and c.requests_held == 8
    assert c.read_seconds == [0.001, 0.003, 0.5] and c.read_bytes == [1000, 3000, 7]
    assert c.held_blocks == 6  # b reported none: a's stays
    assert c.aggregate(sample(held_blocks=0)).held_blocks == 0
    assert a == sample() and a.read_seconds == [0.001, 0.003]  # inputs untouched


def test_reduce_matches_the_connectors_summary():
    r = sample().reduce()
    assert r == {"reads": 2, "blocks_read": 10, "bytes_read": 4000, "failures": 1, "lease_expiries": 1,
                 "recomputes": 1, "releases_sent": 3, "blocks_released": 8, "requests_held": 4,
                 "pushes": 0, "blocks_pushed": 0, "bytes_pushed": 0, "push_failures": 0,
                 "gbps": pytest.approx(4000 / 0.004 / 1e9), "held_blocks": 6}
    assert list(r) == [*COUNTERS, "gbps", "held_blocks"]
    assert KvStats().reduce()["gbps"] == 0.0 and KvStats().reduce()["held_blocks"] == 0


def test_dict_round_trip_through_msgpack():
    s = sample()
    d = msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_dict()))  # as between processes
    assert KvStats.from_dict(d) == s
    assert KvStats().to_dict()["held_blocks"] is None
    assert KvStats.from_dict({"reads": 1}) == KvStats(reads=1)  # missing keys: defaults
    with pytest.raises(SettingsError, match="reads"):
        KvStats.from_dict({"reads": "many"})


def test_pd_kv_stats_delegates():
    from kvtransfer.stats import PdKVStats

    a, b = PdKVStats.of(sample()), PdKVStats.of(sample(held_blocks=2))
    assert PdKVStats().is_empty() and not a.is_empty()
    assert a.aggregate(b) is a
    assert a.kv == sample().aggregate(sample(held_blocks=2))
    assert a.reduce() == a.kv.reduce()
    assert PdKVStats(data=a.to_dict()).kv == a.kv
    a.reset()
    assert a.is_empty()


def families(registry: CollectorRegistry) -> dict:
    """Metric families as scraped (the text parser makes each `_created` series a family of its own)."""
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
            if not f.name.endswith("_created")}


def value(fams: dict, family: str, sample_name: str, **labels) -> float:
    return next(s.value for s in fams[family].samples if s.name == sample_name and s.labels == labels)


def test_observe_exports_the_stats():
    m = KvMetrics(CollectorRegistry())
    m.observe(sample())
    m.observe(sample(read_seconds=[0.2], read_bytes=[2_000_000_000], held_blocks=None).to_dict())  # the dict form
    f = families(m.registry)
    assert value(f, "pdserve_kv_reads", "pdserve_kv_reads_total") == 4
    assert value(f, "pdserve_kv_blocks_transferred", "pdserve_kv_blocks_transferred_total") == 20
    assert value(f, "pdserve_kv_bytes_transferred", "pdserve_kv_bytes_transferred_total") == 8000
    assert value(f, "pdserve_kv_transfer_failures", "pdserve_kv_transfer_failures_total") == 2
    assert value(f, "pdserve_kv_lease_expiries", "pdserve_kv_lease_expiries_total") == 2
    assert value(f, "pdserve_kv_recomputes", "pdserve_kv_recomputes_total") == 2
    assert value(f, "pdserve_kv_held_requests", "pdserve_kv_held_requests_total") == 8
    assert value(f, "pdserve_kv_blocks_released", "pdserve_kv_blocks_released_total") == 16
    h = "pdserve_kv_transfer_duration_seconds"
    assert value(f, h, f"{h}_count") == 3
    assert value(f, h, f"{h}_sum") == pytest.approx(0.204)
    assert value(f, h, f"{h}_bucket", le="0.002") == 1 and value(f, h, f"{h}_bucket", le="0.005") == 2
    assert value(f, "pdserve_kv_transfer_gbps", "pdserve_kv_transfer_gbps") == pytest.approx(10.0)  # the last report's
    assert value(f, "pdserve_kv_held_blocks", "pdserve_kv_held_blocks") == 6  # unreported in the second: kept
    assert m.held_blocks_now == 6
    m.observe({"held_blocks": 0})
    assert m.held_blocks_now == 0 and value(families(m.registry), "pdserve_kv_held_blocks", "pdserve_kv_held_blocks") == 0


def test_gbps_is_left_alone_by_a_report_without_reads():
    m = KvMetrics(CollectorRegistry())
    m.observe(sample())
    m.observe(KvStats(failures=1))
    assert value(families(m.registry), "pdserve_kv_transfer_gbps", "pdserve_kv_transfer_gbps") \
        == pytest.approx(4000 / 0.004 / 1e9)


# The worker's pdserve_kv_* metrics as serve/worker.py defined them before they moved here
# (names, types, help texts), and those added since: dashboards and tests read these.
WORKER_KV_METRICS = {
    "pdserve_kv_reads": ("counter", "Completed KV loads into this engine: READs (pull) or WRITEs received (push); "
                                    "one per request"),
    "pdserve_kv_blocks_transferred": ("counter", "KV blocks read from prefill engines"),
    "pdserve_kv_bytes_transferred": ("counter", "KV bytes read from prefill engines"),
    "pdserve_kv_transfer_duration_seconds": ("histogram", "Duration of one request's KV load: its READ (pull), or "
                                             "from sending the push to its notification (push)"),
    "pdserve_kv_transfer_gbps": ("gauge", "Achieved GB/s of the last KV READs"),
    "pdserve_kv_transfer_failures": ("counter", "KV loads that failed"),
    "pdserve_kv_lease_expiries": ("counter", "Held requests freed unread by lease"),
    "pdserve_kv_recomputes": ("counter", "Requests recomputed locally after a failed load"),
    "pdserve_kv_held_requests": ("counter", "Requests whose blocks were held for a remote decode"),
    "pdserve_kv_blocks_released": ("counter", "Held blocks released by their reader"),
    # Added with the prefill's first token streamed at once (the decode engine runs only it).
    "pdserve_kv_decode_recomputed_prompt_tokens": (
        "counter", "Prompt tokens a decode engine computed although the prefill sent their KV (0 when it ran only "
                   "the new token; the last prompt token each with --first-token-from decode; whole prompts after a "
                   "failed load)"),
    "pdserve_kv_held_blocks": ("gauge", "Blocks held for remote decodes now"),
    # Added with push mode (the prefill side's WRITEs into decode engines).
    "pdserve_kv_pushes": ("counter", "KV WRITEs into decode engines that completed (push mode)"),
    "pdserve_kv_bytes_pushed": ("counter", "KV bytes written into decode engines (push mode)"),
    "pdserve_kv_push_failures": ("counter", "KV WRITEs into decode engines that failed or timed out (push mode)"),
}


def test_definitions_are_the_workers():
    fams = families(KvMetrics(CollectorRegistry()).registry)
    assert {n: (f.type, f.documentation) for n, f in fams.items()} == WORKER_KV_METRICS
    assert list(fams) == list(WORKER_KV_METRICS)  # registered in the worker's order
    for name, fam in fams.items():  # unlabelled, one series each
        assert all(set(s.labels) <= {"le"} for s in fam.samples), name
    buckets = [s.labels["le"] for s in fams["pdserve_kv_transfer_duration_seconds"].samples if "le" in s.labels]
    assert [float(b) for b in buckets] == [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5,
                                           float("inf")]
    assert TRANSFER_BUCKETS == (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5)


def test_shares_a_registry_with_other_metrics():
    from prometheus_client import Counter

    r = CollectorRegistry()
    Counter("pdserve_worker_requests", "Generate requests by outcome", ["role", "outcome"], registry=r)
    m = KvMetrics(r)
    assert m.registry is r
    m.observe(KvStats(reads=1))
    f = families(r)
    assert "pdserve_worker_requests" in f and value(f, "pdserve_kv_reads", "pdserve_kv_reads_total") == 1


def test_metrics_module_needs_no_vllm():
    code = ("import sys, kvtransfer.metrics; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'nixl', 'zmq', 'serve'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
