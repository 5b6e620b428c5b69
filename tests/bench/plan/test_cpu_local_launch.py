"""The launch command `pdserve plan` emits for the embedded model on cpu-local is accepted as
is by `pdserve up`, starts, and serves a request. It runs with `--engine sim` appended (the
same launcher and flags, simulated workers): `pdserve up` on real vLLM engines is
tests/serve/deploy/test_launcher.py's, and the real-engine flags the plan writes
(`--max-num-seqs`, `--tensor-parallel-size`) are vLLM's own."""

from __future__ import annotations

import json
import shlex
import signal

import httpx

from bench.plan.calibrate import _system
from bench.plan.report import PlanInputs, plan
from tests.conftest import MODEL, Proc, free_port


def test_cpu_local_launch_command_serves(tmp_path):
    # A profile of the layout `pdserve bench calibrate` writes (numbers of this machine's order).
    profile = tmp_path / "cpu-local.json"
    profile.write_text(json.dumps(_system(3e10, 5e9, 0.02, 1.5).to_dict()))
    doc = plan(PlanInputs("smollm2-135m-instruct", str(profile), 1, 128, 16, 5000, 500))
    assert doc.winner == "agg"
    up = shlex.split(doc.launch.up)
    assert up[:3] == ["pdserve", "up", "--mode"] and "--kv-cache-dtype" not in up
    port = free_port()
    proc = Proc("plan-launch", [*up[1:], "--engine", "sim", "--port", str(port), "--worker-base-port",
                                str(free_port(8))], env={"PDSERVE_CLUSTER_TOKEN": "plan-launch-token"})
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", 120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        token = {"x-pdserve-token": "plan-launch-token"}
        workers = httpx.get(f"http://127.0.0.1:{port}/internal/workers", timeout=10, headers=token).json()["workers"]
        assert [(w["role"], w["in_rotation"]) for w in workers] == [("agg", True)]
        info = httpx.get(f"{workers[0]['url']}/info", timeout=10, headers=token).json()
        assert info["engine"] == "sim"
    finally:
        proc.stop(signal.SIGTERM)
