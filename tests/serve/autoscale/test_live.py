"""`pdserve autoscale` against a running cluster (the real frontend and a simulated worker,
real HTTP): it observes every request exactly once, sees the pool, decides, explains, and
exports the desired replicas; without --dry-run it refuses in one line."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serve.autoscale.decide import Bounds, Controller, Policy, Targets
from serve.autoscale.live import LiveObserver, client
from serve.autoscale.model import Engine
from serve.autoscale.service import Autoscaler
from serve.sim.timing import LinearStep
from tests.conftest import MODEL


def _send(url: str, n: int) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 4,
           "ignore_eos": True}
    for _ in range(n):
        assert httpx.post(f"{url}/v1/chat/completions", json=req, timeout=60).status_code == 200


def test_the_live_autoscaler_observes_decides_and_explains(sim_agg):
    url = sim_agg.url
    policy = Policy("agg", Targets(0.5, 0.05), Bounds(min_agg=1, max_agg=4, max_workers=4), interval_s=30.0)
    engine = Engine(LinearStep(), max_num_seqs=64)
    scaler = Autoscaler(Controller(policy, {"agg": engine}), LiveObserver([url], ("agg",), 30.0, LinearStep()),
                        dry_run=True)

    async def go() -> list:
        async with client(None, 5.0) as http:
            first = await scaler.once(http)  # history before it looked is not this interval's
            await asyncio.to_thread(_send, url, 25)
            second = await scaler.once(http)
            return [first, second]
    first, second = asyncio.run(go())
    assert first.observation["arrivals"] == 0
    obs = second.observation
    assert obs["arrivals"] == 25 and obs["finished"] == 25 and obs["failed"] == 0
    assert obs["pools"]["agg"]["ready"] == 1 and obs["ttft_p90_s"] > 0 and obs["itl_p90_s"] > 0
    assert second.desired["agg"] >= 1 and second.reason and second.candidates
    doc = scaler.explain()
    assert doc["dry_run"] and len(doc["decisions"]) == 2 and doc["decisions"][0]["t"] == round(second.t, 3)
    fams = {f.name: f for f in text_string_to_metric_families(
        __import__("prometheus_client").generate_latest(scaler.metrics.registry).decode())}
    desired = [s for s in fams["pdserve_autoscaler_desired_replicas"].samples if s.labels == {"pool": "agg"}]
    assert desired and desired[0].value == second.desired["agg"]


def test_autoscale_without_dry_run_or_with_bad_flags_is_one_line(tmp_path, capsys):
    from serve.cli import main

    base = ["autoscale", "--frontend", "http://127.0.0.1:9", "--ttft", "500", "--itl", "50",
            "--profile", str(tmp_path / "none.json")]
    for extra, words in (([], "--actuator kubernetes, or --dry-run"), (["--dry-run"], "--profile"),
                         (["--dry-run", "--min-decode", "5", "--max-decode", "2"], "--min-decode")):
        assert main(base + extra) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pdserve autoscale: error:") and words in lines[0], lines
