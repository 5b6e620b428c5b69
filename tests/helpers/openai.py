"""Checks the OpenAI-endpoint tests share: error envelopes, metric values, worker idleness."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def assert_envelope(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """`r` is an OpenAI error envelope with this status (and param); returns the error."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels`, in a /metrics text."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def wait_idle(worker: str, timeout: float = 30.0) -> dict:
    """The worker's /load once it has no request in flight."""
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(f"{worker}/load").json()
        if load["active_requests"] == 0:
            return load
        assert time.monotonic() < deadline, f"worker still busy: {load}"
        time.sleep(0.05)


def aborted_count(worker: str) -> float:
    return metric_value(httpx.get(f"{worker}/metrics").text, "pdserve_worker_requests_total", {"outcome": "aborted"})
