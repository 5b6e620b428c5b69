"""The fast exposition writes exactly what prometheus_client's generate_latest writes."""

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serve.common.promtext import TextRenderer
from serve.frontend.metrics import FrontendMetrics


def test_the_frontends_metrics_render_byte_for_byte_as_generate_latest():
    m = FrontendMetrics()
    r = TextRenderer(m.registry)
    assert r.render() == generate_latest(m.registry)  # empty
    for i, stage in enumerate(["queue", "tokenize", "route", "prefill", "kv_transfer", "decode_first_step", "other"]):
        m.stages.labels(stage).observe(0.0003 * (i + 1))
    for v in (0.004, 0.2, 1.5, 400.0):
        m.ttft.observe(v)
        m.duration.observe(v * 2)
    m.itl.observe(0.012)
    m.isl.observe(300)
    m.osl.observe(64)
    m.requests.labels("chat", "m", "stream", "200").inc(3)
    m.requests.labels("completions", 'we"ird\\mo\ndel', "unary", "400").inc()
    m.queued.set_function(lambda: 7)
    for i in range(50):
        m.worker_kv_usage.labels(f"http://127.0.0.1:{9000 + i}", "decode").set(i / 49)
    m.worker_active_blocks.labels("http://w:1", "prefill").set(float("inf"))
    m.worker_active_blocks.labels("http://w:2", "prefill").set(math.nan)
    m.worker_active_blocks.labels("http://w:3", "prefill").set(-1e22)
    m.cached.inc(1234567890123)
    for _ in range(2):  # the second render uses the kept prefixes
        assert r.render() == generate_latest(m.registry)
    m.ttft.observe(0.3)
    m.worker_kv_usage.remove("http://127.0.0.1:9000", "decode")
    assert r.render() == generate_latest(m.registry)


def test_names_outside_the_legacy_charset_fall_back_to_generate_latest():
    reg = CollectorRegistry()
    Counter("ok_requests", "fine", ["label"], registry=reg).labels("x").inc()
    Gauge("g", "a gauge", registry=reg).set(2)
    Histogram("h_seconds", "doc with \\ and\nnewline", registry=reg).observe(1)
    assert TextRenderer(reg).render() == generate_latest(reg)
    Gauge("dotted.name", "utf-8 name", registry=reg).set(1)  # escaped by generate_latest
    assert TextRenderer(reg).render() == generate_latest(reg)
