"""What every actuator shares: which workers a scale-down retires, the drain call's outcomes,
and that an interval in which no frontend answered decides and does nothing."""

from __future__ import annotations

import asyncio

import httpx

from serve import protocol as p
from serve.autoscale.actuate import drain, pick_to_retire
from serve.autoscale.decide import Bounds, Controller, Policy, Targets
from serve.autoscale.live import LiveObserver
from serve.autoscale.model import Engine
from serve.autoscale.service import Autoscaler
from serve.sim.timing import LinearStep


def _row(url: str, role: str, inflight: int, in_rotation: bool = True) -> p.WorkerRow:
    return p.WorkerRow(url=url, worker_id=url, role=role, in_rotation=in_rotation, inflight=inflight, failures=0,
                       static=False)


def test_retire_the_least_busy_workers_of_the_pool_in_rotation_newest_first_on_ties():
    rows = [_row("a", "decode", 2), _row("b", "decode", 0), _row("c", "prefill", 0), _row("d", "decode", 0),
            _row("e", "decode", 0, in_rotation=False), _row("f", "decode", 1)]
    assert pick_to_retire(rows, "decode", 2) == ["d", "b"]
    assert pick_to_retire(rows, "decode", 3) == ["d", "b", "f"]
    assert pick_to_retire(rows, "decode", 9) == ["d", "b", "f", "a"]  # never one already leaving
    assert pick_to_retire(rows, "decode", 2, allowed={"a", "f"}) == ["f", "a"]
    assert pick_to_retire(rows, "agg", 1) == [] and pick_to_retire(rows, "decode", 0) == []


def test_drain_reports_drained_busy_and_unreachable():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/internal/drain" and request.url.params["timeout"] == "5.0"
        if request.url.host == "busy":
            return httpx.Response(200, content=p.encode(p.DrainReply(drained=False, active_requests=2, waited_s=5.0)))
        if request.url.host == "down":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, content=p.encode(p.DrainReply(drained=True, active_requests=0, waited_s=0.4)))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return [await drain(http, f"http://{h}:1", 5.0) for h in ("idle", "busy", "down")]
    idle, busy, down = asyncio.run(go())
    assert idle == (True, "drained in 0.4 s")
    assert busy == (False, "2 request(s) still in flight after 5.0 s")
    assert down[0] is False and "ConnectError" in down[1]


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.actions, self.on_action, self.applied = [], None, []

    async def starting(self, http, rows):
        return {}

    async def apply(self, current, desired, rows, http, starting=None):
        self.applied.append((current, desired))
        return []

    async def close(self):
        pass


def test_no_frontend_answering_is_no_decision_and_no_action():
    policy = Policy("agg", Targets(0.5, 0.05), Bounds(min_agg=2, max_agg=4))
    act = _Recorder()
    scaler = Autoscaler(Controller(policy, {"agg": Engine(LinearStep())}),
                        LiveObserver(["http://127.0.0.1:9"], ("agg",), 30.0, timeout_s=1.0), False, act)

    async def go():
        async with httpx.AsyncClient(timeout=1.0) as http:
            return await scaler.once(http)
    # the pool unseen is not a pool of 0 that needs 2 workers started
    assert asyncio.run(go()) is None and act.applied == [] and scaler.skipped == 1 and not scaler.decisions


def test_frontends_behind_a_name_are_each_observed():
    obs = LiveObserver(["dns+http://localhost:8123", "http://10.1.1.1:8000/"], ("agg",), 30.0)
    urls = asyncio.run(obs.frontend_urls())
    assert "http://127.0.0.1:8123" in urls and urls[-1] == "http://10.1.1.1:8000/".rstrip("/")
