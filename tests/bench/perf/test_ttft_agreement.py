"""The TTFT-agreement benchmark's reading of the frontend's histogram: the quantile of what
it observed between two scrapes, interpolated within a bucket as Prometheus does."""

from __future__ import annotations

import pytest

from bench.perf.ttft_agreement import quantile
from serve.frontend.metrics import FrontendMetrics


def scrape(m: FrontendMetrics) -> dict[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name == "pdserve_frontend_time_to_first_token_seconds_bucket":
                out[float(s.labels["le"])] = s.value
    return out


def test_the_quantile_of_a_run_ignores_what_came_before_it():
    m = FrontendMetrics()
    for _ in range(50):
        m.ttft.observe(5.0)  # an earlier run, far off
    before = scrape(m)
    values = [0.1 + 0.01 * i for i in range(101)]  # 0.10 .. 1.10 s, p50 0.60
    for v in values:
        m.ttft.observe(v)
    after = scrape(m)
    p50 = quantile(before, after, 0.5)
    assert p50 == pytest.approx(0.60, rel=0.09)  # buckets 9% apart there
    assert quantile(before, after, 0.9) == pytest.approx(1.0, rel=0.09)
    assert quantile(after, after, 0.5) is None  # nothing observed in between
    assert quantile({}, after, 1.0) == pytest.approx(5.0)  # with no baseline the earlier run counts too


def test_the_mean_prompt_length_of_a_run_comes_from_the_histograms_sum_and_count(monkeypatch):
    import httpx

    from bench.perf import ttft_agreement

    m = FrontendMetrics()
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200, text=m.render().decode()))
    m.isl.observe(1000)  # before the run
    s0, c0 = ttft_agreement.sum_count("http://frontend", ttft_agreement.ISL)
    for n in (100, 140, 120):
        m.isl.observe(n)
    s1, c1 = ttft_agreement.sum_count("http://frontend", ttft_agreement.ISL)
    assert (c1 - c0, (s1 - s0) / (c1 - c0)) == (3, pytest.approx(120.0))
