"""The local actuator on `pdserve up --engine sim --autoscale`'s launcher (real processes, real
HTTP): a scale-up starts a worker process that registers and serves; a scale-down while
streams are in flight drains the picked workers first, so every stream finishes whole, then
stops their processes; the launcher leaves no process behind."""

from __future__ import annotations

import asyncio
import threading

import httpx

from serve.autoscale.local import LocalActuator
from serve.deploy.launcher import Launcher
from serve.deploy.settings import UpSettings
from serve.protocol import WorkersReply, decoder
from tests.conftest import MODEL
from tests.helpers.procs import free_port

TOKENS = 150  # 3 s a stream at 20 ms a step


def _rows(url: str) -> list:
    r = httpx.get(f"{url}/internal/workers", timeout=5)
    return decoder(WorkersReply)(r.raise_for_status().content).workers


def _stream(url: str, out: list, i: int, tokens: int = TOKENS) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": f"Story {i}"}], "max_tokens": tokens,
           "ignore_eos": True, "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=req, timeout=60) as r:
            body = "".join(r.iter_text())
            out.append((r.status_code, f'"completion_tokens":{tokens}' in body.replace(" ", ""),
                        body.rstrip().endswith("data: [DONE]")))
    except httpx.HTTPError as exc:
        out.append((0, False, repr(exc)))


def test_local_actuator_scales_up_and_retires_without_dropping_a_stream(model_dir):
    from serve.cli import build_parser

    fe_port, scaler_port, base = free_port(), free_port(), free_port(8)
    args = build_parser().parse_args([
        "up", "--engine", "sim", "--workers", "2", "--autoscale", "--ttft", "500", "--itl", "50",
        "--interval", "3600",  # its own controller stays idle: this test drives an actuator itself
        "--sim-step-model", "constant:0.02", "--max-num-seqs", "8", "--port", str(fe_port),
        "--worker-base-port", str(base), "--autoscale-port", str(scaler_port), "--model", model_dir,
        "--served-model-name", MODEL, "--ready-timeout", "120"])
    launcher = Launcher(UpSettings.from_args(args))
    try:
        launcher.start()
        fe = f"http://127.0.0.1:{fe_port}"
        doc = httpx.get(f"http://127.0.0.1:{scaler_port}/autoscaler", timeout=5).json()
        assert doc["actuator"] == "local" and not doc["dry_run"] and doc["mode"] == "agg"
        assert [r.role for r in _rows(fe) if r.in_rotation] == ["agg", "agg"] and not any(r.static for r in _rows(fe))
        own = {u: (r, c) for u, r, c in launcher._own_workers()}
        act = LocalActuator(launcher, own, drain_timeout_s=30.0)

        async def up() -> dict:
            async with httpx.AsyncClient() as http:
                acts = await act.apply({"agg": 2}, {"agg": 3}, _rows(fe), http)
                assert [a.kind for a in acts] == ["start"]
                for _ in range(120):
                    if not (await act.starting(http)):
                        break
                    await asyncio.sleep(0.5)
                return await act.starting(http)
        assert asyncio.run(up()) == {}
        for _ in range(40):  # registered with the frontend (renewals every few seconds)
            if sum(r.in_rotation for r in _rows(fe)) == 3:
                break
            threading.Event().wait(0.5)
        assert sum(r.in_rotation for r in _rows(fe)) == 3

        results: list = []
        clients = [threading.Thread(target=_stream, args=(fe, results, i)) for i in range(9)]
        for t in clients:
            t.start()
        threading.Event().wait(1.0)  # every stream under way, on every worker

        async def down() -> tuple[list, list]:
            async with httpx.AsyncClient() as http:
                rows = _rows(fe)
                acts = await act.apply({"agg": 3}, {"agg": 1}, rows, http)
                await act.settle(60.0)
                return acts, rows
        acts, before = asyncio.run(down())
        assert [a.kind for a in acts] == ["drain", "drain"]
        # the retired workers were serving streams when their drain began
        assert sum(r.inflight for r in before if r.url in {a.target for a in acts}) > 0, before
        for t in clients:
            t.join(60)
        assert len(results) == 9 and all(r == (200, True, True) for r in results), results
        kinds = [a.kind for a in act.actions]
        assert kinds.count("drained") == 2 and kinds.count("stop") == 2 and "error" not in kinds, kinds
        retired = {a.target for a in act.actions if a.kind == "stop"}
        rows = _rows(fe)
        assert [r.url for r in rows if r.in_rotation] and not retired & {r.url for r in rows if r.in_rotation}
        alive = [c for _, _, c in launcher._own_workers() if c.popen.poll() is None]
        assert len(alive) == 1
    finally:
        children = list(launcher.children)
        launcher.stop()
    assert all(c.popen.poll() is not None for c in children)


def test_up_autoscale_follows_the_load_on_its_own(model_dir):
    """The controller's own loop: under a load one worker cannot carry, the next decision
    starts workers; they register and serve; GET /autoscaler shows the decision and what the
    actuator did."""
    from serve.cli import build_parser

    fe_port, scaler_port, base = free_port(), free_port(), free_port(8)
    args = build_parser().parse_args([
        "up", "--engine", "sim", "--workers", "1", "--autoscale", "--ttft", "500", "--itl", "50", "--interval", "2",
        "--max-agg", "4", "--sim-step-model", "constant:0.02", "--max-num-seqs", "2", "--port", str(fe_port),
        "--worker-base-port", str(base), "--autoscale-port", str(scaler_port), "--model", model_dir,
        "--served-model-name", MODEL, "--ready-timeout", "120"])
    launcher = Launcher(UpSettings.from_args(args))
    try:
        launcher.start()
        fe, api = f"http://127.0.0.1:{fe_port}", f"http://127.0.0.1:{scaler_port}"
        results: list = []
        clients = []
        for i in range(24):  # 6 requests/s for 4 s; one worker carries 2 / (64 x 20 ms) = 1.6/s
            t = threading.Thread(target=_stream, args=(fe, results, i, 64))
            t.start()
            clients.append(t)
            threading.Event().wait(1 / 6)
        for _ in range(40):
            doc = httpx.get(f"{api}/autoscaler", timeout=5).json()
            if any(a["kind"] == "ready" for a in doc["actions"]):
                break
            threading.Event().wait(0.5)
        for t in clients:
            t.join(120)
        ups = [d for d in doc["decisions"] if d["desired"]["agg"] > d["current"]["agg"]]
        assert ups and "needed for" in ups[-1]["reason"] and ups[-1]["actions"][0]["kind"] == "start", doc["decisions"]
        assert any(a["kind"] == "ready" for a in doc["actions"])
        assert sum(r.in_rotation for r in _rows(fe)) >= 2
        assert len(results) == 24 and all(r == (200, True, True) for r in results), results
        metrics = httpx.get(f"{api}/metrics", timeout=5).text
        assert 'pdserve_autoscaler_actions_total{kind="start",pool="agg"}' in metrics
    finally:
        launcher.stop()


def test_up_autoscale_bad_flags_are_one_line_before_anything_starts(capsys):
    from serve.cli import main

    for argv, words in ((["--autoscale", "--ttft", "500", "--itl", "50"], "--autoscale-profile"),
                        (["--autoscale", "--engine", "sim"], "--ttft MS and --itl MS"),
                        (["--autoscale", "--engine", "sim", "--ttft", "500", "--itl", "50", "--min-agg", "3",
                          "--max-agg", "2"], "--min-agg 3 --max-agg 2")):
        assert main(["up", "--port", "9", *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines
