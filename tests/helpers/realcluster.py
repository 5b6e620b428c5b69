"""One real disaggregated cluster for the whole test session: the real frontend, a prefill
worker on core 0 and a decode worker on core 1 (vLLM engines, KV over NIXL), started once
and shared by tests/serve/test_disagg_e2e.py and tests/serve/test_faults.py (the `real_disagg`
fixture in tests/conftest.py).

test_faults kills, restarts and adds workers, so it must be the last module that uses the
cluster; it is collected after test_disagg_e2e, and the engine tests run in collection
order on one xdist worker (tests/conftest.py). Tests that read counters compare before and
after, never absolute values, so they do not depend on what ran before them.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from serve.common.procs import signal_group
from tests.helpers.procs import ENGINE_FLAGS, ENGINE_READY_TIMEOUT_S, MODEL, Proc, free_port
from tests.helpers.workerclient import metric, metrics, reset_prefix_cache, wait_for

# The prefill side's KV lease. The transfer-fault tests hold a decode worker before its READ
# for up to a lease, and must see the hold within that window: polling /metrics of a busy
# 2-core machine can take a second a call, so the window is several seconds wide.
LEASE_S = 6.0


class RealCluster:
    """Processes by name ("frontend", "prefill", "decode1", ...) and their URLs. Every
    worker has a pause file (PDSERVE_KV_FAULT_PAUSE_FILE, the test-only hook that holds a
    decode before its READ)."""

    def __init__(self, model_dir: str, tmp: Path) -> None:
        self.model_dir = model_dir
        self.tmp = tmp
        self.procs: dict[str, Proc] = {}
        self.urls: dict[str, str] = {}
        self.ready: set[str] = set()  # started and answered /health since (wait_ready)
        port = free_port()
        self.frontend = f"http://127.0.0.1:{port}"
        self.procs["frontend"] = Proc("cluster-frontend", [
            "frontend", "--port", str(port), "--model", model_dir, "--served-model-name", MODEL,
            "--prefill-timeout", "30", "--request-timeout", "120"])

    def pause_file(self, name: str) -> Path:
        return self.tmp / f"pause-{name}"

    def start(self, name: str, role: str, core: int, port: int | None = None) -> None:
        port = port or free_port()
        self.ready.discard(name)
        self.urls[name] = f"http://127.0.0.1:{port}"
        self.procs[name] = Proc(f"cluster-{name}", [
            "worker", "--role", role, "--port", str(port), "--model", self.model_dir, "--served-model-name", MODEL,
            "--cpu-cores", str(core), "--kv-cache-gib", "1", "--max-num-seqs", "8", "--max-model-len", "4096",
            "--lease-seconds", "2", "--kv-lease-seconds", str(LEASE_S), "--frontend", self.frontend,
            *ENGINE_FLAGS],
            env={"PDSERVE_KV_FAULT_PAUSE_FILE": str(self.pause_file(name))})

    def wait_ready(self, *names: str) -> None:
        for n in names:
            self.procs[n].wait_http(f"{self.urls[n]}/health", ENGINE_READY_TIMEOUT_S)
            self.ready.add(n)
        wait_for(lambda: set(self.in_rotation()) >= {self.urls[n] for n in names}, 30, f"{names} in rotation")

    def in_rotation(self) -> list[str]:
        return [w["url"] for w in httpx.get(f"{self.frontend}/internal/workers").json()["workers"] if w["in_rotation"]]

    def running(self) -> list[str]:
        """The workers that have been ready and are still running (one still loading is not)."""
        return [n for n in self.urls if n in self.ready and self.procs[n].popen.poll() is None]

    def decoders(self) -> list[str]:
        """The decode workers that have been ready and are still running."""
        return [n for n in ("decode1", "decode2") if n in self.running()]

    def reset_prefix_caches(self, *names: str) -> None:
        """Empty the prefix caches of the named workers (default: all running ones). Answers
        compared across tests must start from the same cache state: a prompt prefilled
        whole and one prefilled past a cached prefix get bf16 logits apart by up to ~0.07 here,
        enough to flip a greedy token at a near-tie."""
        for n in names or self.running():
            reset_prefix_cache(self.urls[n])

    def kill(self, name: str) -> None:
        self.ready.discard(name)
        self.procs[name].stop(sig=signal.SIGKILL)

    def free_blocks(self) -> dict[str, tuple[int, int]]:
        """worker -> (active KV blocks, blocks held for remote decodes)."""
        out = {}
        for n in self.running():
            load = httpx.get(f"{self.urls[n]}/load", timeout=10).json()
            out[n] = (load["active_blocks"], metric(metrics(self.urls[n]), "pdserve_kv_held_blocks"))
        return out

    def stop(self) -> None:
        """SIGTERM to every process at once (they drain in parallel), then each one's stop."""
        for p in self.procs.values():
            if p.poll() is None:
                signal_group(p.popen, signal.SIGTERM)
        for p in reversed(list(self.procs.values())):
            p.stop()


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _warm_up(c: RealCluster) -> None:
    """One split request before any test counts: the pair's handshake and both engines' first
    steps (on CI the first transfer of a fresh pair once came after a short lease had run out,
    with another test's engines on the same cores). Its prompt is under a block, so it leaves
    no prefix behind; returns once the prefill worker holds nothing."""
    r = httpx.post(f"{c.frontend}/v1/chat/completions", timeout=ENGINE_READY_TIMEOUT_S,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    wait_for(lambda: metric(metrics(c.urls["prefill"]), "pdserve_kv_held_blocks") == 0, LEASE_S + 10,
             "the warm-up's hold released")


def start_real_cluster(model_dir: str, tmp: Path) -> RealCluster:
    """Frontend, then both engines loading at once (one core each); returns when both are in
    rotation. Stops everything it started if that fails."""
    c = RealCluster(model_dir, tmp)
    try:
        wait_for(lambda: _up(c.frontend), 60, "frontend up")
        c.start("prefill", "prefill", 0)
        c.start("decode1", "decode", 1)
        c.wait_ready("prefill", "decode1")
        _warm_up(c)
    except BaseException:
        c.stop()
        raise
    return c
