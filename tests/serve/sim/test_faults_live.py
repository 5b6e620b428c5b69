"""Faults on demand on live simulated workers (`POST /sim/fault`), behind the real frontend
in this process: a slowed engine, a stalled transfer and a killed engine each do what they
say, and the cluster still answers."""

from __future__ import annotations

import asyncio

from serve.sim.cluster import SimCluster
from tests.serve.sim.test_cluster import complete, metric, metrics


def test_slow_step_stall_transfer_and_kill_on_demand(model_dir):
    async def run() -> None:
        async with SimCluster(model_dir, ["prefill", "decode", "decode"],
                              engine_flags=["--sim-step-model", "constant:0.002"]) as c:
            prefill, (d1, d2) = c.urls("prefill")[0], c.urls("decode")
            bad = await c.client.post(f"{d1}/sim/fault", json={"fault": "slow_step", "factor": 0.5})
            assert bad.status_code == 400 and "'factor' must be a number >= 1" in bad.json()["error"]
            assert (await c.client.post(f"{prefill}/sim/fault", json={"fault": "stall_transfer", "seconds": 1})
                    ).status_code == 400  # a prefill worker does not READ
            r = await c.client.post(f"{d1}/sim/fault", json={"fault": "slow_step", "factor": 4})
            assert r.json() == {"engine": "sim", "slow_step": 4.0, "stall_transfer_s": 0.0, "killed": False}
            backend = c.workers[d1].backend
            from serve.sim.engine import SimRequest
            req = SimRequest("x", [1] * 10, None, b"", in_prefill=False, output=[2])  # type: ignore[arg-type]
            assert backend.engine.step_time([(req, 1)]) == 4 * 0.002
            # Stalled READs: every split request still answers, after waiting out the stall.
            for d in (d1, d2):
                await c.client.post(f"{d}/sim/fault", json={"fault": "stall_transfer", "seconds": 0.3})
            answers = [await complete(c, f"Question {i}: why is the sky blue?", 6) for i in range(4)]
            assert all(a["choices"][0]["text"] for a in answers)
            reads = 0.0
            for _ in range(50):  # KV stats reach /metrics at the worker's next report (every 50 ms)
                reads = 0.0
                for d in (d1, d2):
                    reads += metric(await metrics(c, d), "pdserve_kv_reads_total")
                if reads == 4:
                    break
                await asyncio.sleep(0.1)
            assert reads == 4
            # Kill one decode engine: it says so, and the frontend serves from the other.
            r = await c.client.post(f"{d1}/sim/fault", json={"fault": "kill"})
            assert r.json()["killed"] is True
            assert (await c.client.get(f"{d1}/live")).status_code == 503
            assert (await c.client.get(f"{d1}/health")).status_code == 503
            for r in (await c.client.get(f"{d1}/load"), await c.client.post(f"{d1}/reset_prefix_cache")):
                assert r.status_code == 503 and r.json()["error"] == "engine core is dead", r.text
            await c.client.post(f"{d2}/sim/fault", json={"fault": "clear"})
            left = False
            for _ in range(100):  # until the frontend's poller takes it out of rotation
                rows = (await c.client.get(f"{c.url}/internal/workers")).json()["workers"]
                if [w["in_rotation"] for w in rows if w["url"] == d1] == [False]:
                    left = True
                    break
                await asyncio.sleep(0.1)
            assert left
            answers = [await complete(c, f"After the kill {i}", 6) for i in range(4)]
            assert all(a["choices"][0]["text"] for a in answers)

    asyncio.run(run())
