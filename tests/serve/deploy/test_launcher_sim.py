"""`pdserve up --engine sim`: the launcher's real processes with simulated workers (seconds,
not minutes), and the frontend's port taken before any worker starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from serve.common import procs
from tests.conftest import LOG_DIR, MODEL, ROOT, free_port


def test_up_with_simulated_workers_serves_disaggregated_then_stops_everything(model_dir):
    port, base = free_port(), free_port(7)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"up-sim-{time.time_ns()}.log"
    child = procs.Child("up-sim", [sys.executable, "-m", "serve.cli", "up", "--engine", "sim", "--mode", "disagg",
                                   "--prefill", "3", "--decode", "4", "--port", str(port), "--worker-base-port",
                                   str(base), "--model", model_dir, "--served-model-name", MODEL,
                                   "--sim-step-model", "constant:0.004", "--worker-nice", "7"], log_path, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while "pdserve is up" not in log_path.read_text():
            assert child.poll() is None and time.monotonic() < deadline, child.tail()
            time.sleep(0.2)
        out = log_path.read_text()
        assert "3 simulated prefill, 4 simulated decode" in out
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        # One process per role, each with all of that role's workers.
        kids = procs.children(child.pid)
        assert len(kids) == 3, [procs.cmdline(k) for k in kids]  # prefill, decode, frontend
        workers = [procs.cmdline(k) for k in kids if " worker " in procs.cmdline(k)]
        assert len(workers) == 2 and all("--sim-step-model constant:0.004" in c for c in workers), workers
        # --worker-nice: the workers run at niceness 7, the frontend at the launcher's own
        nices = {k: os.getpriority(os.PRIO_PROCESS, k) for k in kids}
        own = os.getpriority(os.PRIO_PROCESS, child.pid)
        assert sorted(nices.values()) == sorted([own, min(own + 7, 19), min(own + 7, 19)]), nices
        assert all(n == min(own + 7, 19) for k, n in nices.items() if " worker " in procs.cmdline(k)), nices
        everyone = procs.descendants(child.pid)
        child.send_signal(signal.SIGTERM)
        child.popen.wait(timeout=60)
        assert child.popen.returncode == 0, child.tail()
        left = [procs.cmdline(p) for p in everyone if procs.alive(p)]
        assert not left, left
    finally:
        child.stop()


def test_sim_options_need_the_sim_engine():
    r = subprocess.run([sys.executable, "-m", "serve.cli", "up", "--sim-step-model", "constant:1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "pdserve up: error: --sim-step-model needs --engine sim"


def test_a_worker_niceness_out_of_range_is_one_line():
    r = subprocess.run([sys.executable, "-m", "serve.cli", "up", "--worker-nice", "20"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "pdserve up: error: --worker-nice 20: a niceness from 0 to 19"


def test_push_transfers_need_real_engines_in_one_line():
    for cmd in (["up", "--engine", "sim", "--mode", "disagg", "--kv-transfer-mode", "push"],
                ["worker", "--engine", "sim", "--role", "decode", "--kv-transfer-mode", "push"]):
        r = subprocess.run([sys.executable, "-m", "serve.cli", *cmd], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and r.stderr.strip() == (
            f"pdserve {cmd[0]}: error: --kv-transfer-mode push needs real engines: simulated workers model pull "
            "transfers"), r.stderr


def test_up_fails_at_once_when_its_port_is_taken(model_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "serve.cli", "up", "--engine", "sim", "--port", str(port),
                            "--worker-base-port", str(free_port()), "--model", model_dir], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"pdserve up: error: cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "started" not in r.stdout  # no worker was started
    assert time.monotonic() - t0 < 30
