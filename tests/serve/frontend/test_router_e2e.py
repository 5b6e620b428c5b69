"""KV-aware routing with two prefill workers and real KV events: a follow-up that shares a
long prefix lands on the prefill worker that served the prefix, and reports cached tokens."""

from __future__ import annotations

import os
import stat

import httpx
import pytest

from tests.conftest import MODEL
from tests.serve.test_disagg_e2e import roles_in_rotation, start_frontend, start_worker
from tests.helpers.workerclient import metric, metrics, wait_for

pytestmark = pytest.mark.engine
# Each prefix is one first request and one follow-up; five keep the suite's time in bounds
# (three engines share two cores here).
PREFIXES = 5
# A short KV lease bounds the cost of the known holder stall (closing note, stop 10: a READ
# or acquire occasionally completes only at lease expiry with three engines on two cores);
# the routing assertions do not depend on the transfer succeeding.
LEASE = ["--kv-lease-seconds", "6"]


def served(urls: list[str]) -> dict[str, float]:
    return {u: metric(metrics(u), "pdserve_worker_requests_total", role="prefill", outcome="ok") for u in urls}


def one_more(before: dict[str, float], now: dict[str, float]) -> dict[str, float] | None:
    return now if sum(now.values()) == sum(before.values()) + 1 else None


def test_shared_prefixes_return_to_their_prefill_worker(model_dir):
    procs = []
    try:
        fe, furl = start_frontend(model_dir, [])
        procs.append(fe)
        p0, u0 = start_worker("prefill", 0, model_dir, furl, extra=LEASE, wait=False)
        procs.append(p0)
        p1, u1 = start_worker("prefill", 1, model_dir, furl, extra=LEASE, wait=False)
        procs.append(p1)
        for proc, url in ((p0, u0), (p1, u1)):  # two engines load at once (three run out of memory here)
            proc.wait_http(f"{url}/health", 420)
        d, ud = start_worker("decode", 0, model_dir, furl, extra=LEASE)
        procs.append(d)
        wait_for(lambda: roles_in_rotation(furl) == ["decode", "prefill", "prefill"], 30, "workers registered")
        sockets = []
        for u in (u0, u1):  # loopback workers publish KV events on a private Unix socket, not on all interfaces
            ev = httpx.get(f"{u}/info", timeout=5).json()["kv_events_endpoint"]
            assert ev.startswith("ipc://"), ev
            sockets.append(ev[len("ipc://"):])
            assert os.path.exists(sockets[-1]) and stat.S_IMODE(os.stat(os.path.dirname(sockets[-1])).st_mode) == 0o700
        hits = 0
        for i in range(PREFIXES):
            prefix = f"Document {i}. " + " ".join(f"Fact {i}.{j}: value {(i * 31 + j * 7) % 101}." for j in range(90))
            first = [{"role": "system", "content": prefix}, {"role": "user", "content": "Summarize fact 3."}]
            before = served([u0, u1])
            r = httpx.post(f"{furl}/v1/chat/completions", timeout=120,
                           json={"model": MODEL, "messages": first, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            # The worker counts a request just after its stream ends: wait for the count.
            after = wait_for(lambda: one_more(before, served([u0, u1])), 10, "prefill request counted")
            owner = next(u for u in (u0, u1) if after[u] == before[u] + 1)
            follow = [{"role": "system", "content": prefix}, {"role": "user", "content": "Now summarize fact 9."}]
            # The owner's KV events reach the router's index shortly after the prefill.
            wait_for(lambda: httpx.post(f"{furl}/v1/route/explain", json={"model": MODEL, "messages": follow})
                     .json()["prefill"]["chosen"] == owner, 10, f"prefix {i} indexed on {owner}")
            before = served([u0, u1])
            explained = httpx.post(f"{furl}/v1/route/explain", json={"model": MODEL, "messages": follow}).json()
            r = httpx.post(f"{furl}/v1/chat/completions", timeout=120,
                           json={"model": MODEL, "messages": follow, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200
            after = wait_for(lambda: one_more(before, served([u0, u1])), 10, "prefill request counted")
            assert after[owner] == before[owner] + 1, f"follow-up {i} went elsewhere: {explained} {before} {after}"
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 128, cached
            hits += 1
        assert hits == PREFIXES
        ratio = metrics(furl)
        assert metric(ratio, "pdserve_router_cached_token_ratio_count") >= 2 * PREFIXES
    finally:
        for proc in reversed(procs):
            proc.stop()
    assert not any(os.path.exists(p) for p in sockets), sockets  # a stopped worker removes its socket
