"""The autoscaler on the offline simulator (bench/sim/scaling.py, bench/sim/scenarios.py): it
starts workers after their start-up time, stops them only through drain (no request fails,
no worker leaves with work in flight), counts worker-hours, and the scenario helpers measure
windows, reversals and the static baseline."""

from __future__ import annotations

from bench.sim import scenarios as S


def _scenario(name: str, rates: tuple[tuple[float, float], ...], duration: float) -> S.Scenario:
    return S.Scenario(name, duration, S._steps(*rates), lambda t: 3000, lambda t: 40, (rates[0][0],), describe=name)


def test_a_step_up_then_down_is_followed_without_a_failed_request(tmp_path):
    s = _scenario("up-down", ((120, 1.0), (360, 6.0), (1300, 0.5)), 1300)
    tr = tmp_path / "trace.jsonl"
    n = S.trace(s, tr)
    start = S._layout_at(s, 0.0)
    r = S.run_one(s, tr, tmp_path / "auto", *start, True)
    assert r["requests"] == n and r["failed"] == 0
    a = r["autoscaler"]
    timeline = a["timeline"]
    peak = max(x["prefill"] + x["decode"] for x in timeline)
    assert peak > sum(start)  # it scaled up for the step
    assert timeline[-1]["prefill"] + timeline[-1]["decode"] < peak  # and back down through drain
    ups = [d for d in a["decisions"] if sum(d["desired"].values()) > sum(d["current"].values())]
    downs = [d for d in a["decisions"] if sum(d["desired"].values()) < sum(d["current"].values())]
    assert ups and downs and min(d["t"] for d in downs) - max(d["t"] for d in ups) >= 600
    assert a["reversals_within_10min"] == 0
    assert 0 < r["worker_hours"] < peak * 1300 / 3600
    assert all(d["reason"] for d in a["decisions"])


def test_windows_reversals_and_misses_are_counted():
    class D:  # a decision as the scaler keeps it
        def __init__(self, t, cur, want):
            self.t, self.current, self.desired = t, cur, want
    scaler = type("S", (), {"decisions": [D(0, {"p": 1}, {"p": 3}), D(300, {"p": 3}, {"p": 2}),
                                          D(1000, {"p": 2}, {"p": 4}), D(1700, {"p": 4}, {"p": 3})]})()
    assert S.reversals(scaler) == 1  # 300 s after an up; the down at 1700 is 700 s after its up
    ws = [{"minute": m, "met": m not in (10, 11, 25)} for m in range(30)]
    assert S._misses(ws, (600.0, 1200.0)) == [2, 1]
