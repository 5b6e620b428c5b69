"""The autoscaler on the offline simulator (bench/sim/scaling.py, bench/sim/scenarios.py): it
starts workers after their start-up time, stops them only through drain (no request fails,
no worker leaves with work in flight), counts worker-hours, and the scenario helpers measure
windows, reversals and the static baseline."""

from __future__ import annotations

import json

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
    assert S.misses_per_event(ws, (600.0, 1200.0)) == [2, 1]


def test_a_window_is_missed_by_failures_but_not_by_requests_lost_with_a_killed_worker():
    """A request that died with a worker the scenario killed misses no window (every layout
    loses it, so it cannot tell a static layout from an autoscaled one); any other failure
    does, as does a p90 over target."""
    from bench.loadgen.records import ErrorInfo, Record

    def rec(minute: int, ttft_s: float = 0.1, error: str | None = None) -> Record:
        start = int(minute * S.WINDOW_S * 1e9)
        r = Record(0, 0, "profiling", 0, start, start, content_ns=[start + int(ttft_s * 1e9), start + int(ttft_s * 1e9)
                                                                  + int(S.ITL_S * 0.5e9)])
        if error:
            r.error, r.content_ns = ErrorInfo(502, "worker_error", error), []
        return r
    killed = ["http://sim-decode-3:8100"]
    records = [rec(0), rec(0), rec(1), rec(1, error="worker http://sim-decode-3:8100 died"),
               rec(2), rec(2, error="worker http://sim-decode-1:8100 died"), rec(3, ttft_s=S.TTFT_S * 2)]
    ws = S.windows(records, killed)
    assert [w["met"] for w in ws] == [True, True, False, False]
    assert [(w["failed"], w["lost"]) for w in ws] == [(0, 0), (1, 1), (1, 0), (0, 0)]
    assert [w["met"] for w in S.windows(records)] == [True, False, False, False]  # nothing killed: a failure


def test_live_windows_count_failures_at_the_kill_as_lost_and_any_other_as_a_miss(tmp_path):
    """bench/sim/live.py reads the client's export: a failure that started before the kill and
    ended within LOST_WITHIN_S after it was lost with the killed workers (no miss); one that
    ended before the kill, or long after it, is a failure of its own (a miss)."""
    import json

    from bench.loadgen.export import record_line
    from bench.loadgen.records import ErrorInfo, Record
    from bench.sim import live as L

    kill = 10 * 60 * 10**9  # minute 10 of the run

    def rec(start_s: float, took_s: float, failed: bool) -> Record:
        start = int(start_s * 1e9)
        r = Record(0, 0, "profiling", 0, start, start, end_ns=start + int(took_s * 1e9))
        if failed:
            r.error = ErrorInfo(502, "worker_error", "worker failed: ReadError")
        else:
            r.content_ns = [start + int(0.1e9), start + int(0.2e9)]
        return r
    records = [rec(0, 1, False), rec(595, 6, True),  # minute 9: lost at the kill
               rec(540, 30, True),  # minute 9 as well: failed before the kill
               rec(610, 1, False), rec(650, 100, True)]  # minute 10: failed 150 s after the kill
    export = tmp_path / "profile_export.jsonl"
    export.write_text("".join(json.dumps(record_line(r)) + "\n" for r in records))
    ws, n, failed = L.windows(export, kill)
    assert (n, failed) == (5, 3)
    assert [(w["minute"], w["failed"], w["lost"], w["met"]) for w in ws] == [(0, 0, 0, True), (9, 2, 1, False),
                                                                            (10, 1, 0, False)]
    export.write_text(json.dumps(record_line(records[0])) + "\n" + json.dumps(record_line(records[1])) + "\n")
    assert [w["met"] for w in L.windows(export, kill)[0]] == [True, True]
    assert [w["met"] for w in L.windows(export)[0]] == [True, False]  # nothing killed: a miss


def test_the_live_pool_loss_kills_the_worker_on_that_port_and_only_it():
    import subprocess
    import sys

    import pytest

    from bench.sim import live as L

    code = "import time; time.sleep(60)"
    target = subprocess.Popen([sys.executable, "-c", code, "--port", "18997", "--x"])
    other = subprocess.Popen([sys.executable, "-c", code, "--port", "189970"])
    try:
        L.kill_port(18997)
        assert target.wait(10) == -9
        assert other.poll() is None  # a longer port with the same digits is not it
        with pytest.raises(RuntimeError, match="no process with --port 18997"):
            L.kill_port(18997)
    finally:
        for p in (target, other):
            p.kill()
            p.wait()


def test_the_static_baseline_meets_every_window_of_every_trace(tmp_path, monkeypatch):
    """A layout met on one trace by luck is not the baseline: with a second trace on which
    2P+2D misses TTFT, the search grows prefill (run_one stands in for the simulator here:
    trace a is met from 2P+2D, trace b needs 3 prefill workers)."""
    calls = []

    def fake_run(s, tr, out, p, d, autoscale):
        calls.append((tr.name, p, d))
        ok = p >= 2 and d >= 2 and (tr.name == "a" or p >= 3)
        w = {"minute": 0, "requests": 10, "failed": 0, "lost": 0, "ttft_p90_s": 1.0 if ok else 9.0,
             "itl_p90_s": 0.01, "met": ok}
        return {"windows": [w], "worker_hours": (p + d) / 2}
    monkeypatch.setattr(S, "run_one", fake_run)
    s = _scenario("flat", ((100, 1.0),), 100)
    one = S.baseline(s, [tmp_path / "a"], tmp_path, (2, 2))
    assert one["layout"] == "2P+2D" and one["meets_every_window"]
    both = S.baseline(s, [tmp_path / "a", tmp_path / "b"], tmp_path, (2, 2))
    assert both["layout"] == "3P+2D" and both["meets_every_window"] and both["worker_hours"] == 2.5
    assert both["missed_per_trace"]["2P+2D"] == [0, 1] and both["missed_per_trace"]["3P+2D"] == [0, 0]
    assert ("b", 3, 2) in calls
    # a layout out on its first trace is not run on the others
    assert both["missed_per_trace"]["3P+1D"] == [1] and ("b", 3, 1) not in calls


def test_scenarios_refuse_a_seed_count_out_of_range(capsys):
    assert S.main(["diurnal", "--seeds", "0"]) == 2
    assert "--seeds must be 1 to" in capsys.readouterr().err


def test_a_cooldown_sweep_runs_the_autoscaled_traces_only(tmp_path, monkeypatch):
    """`--cooldown S --no-baseline`: the controller gets the cool-down, no static layout is
    simulated, and the table says the baseline was not searched."""
    calls = []

    def fake_run(s, tr, out, p, d, autoscale, cooldown_s=S.COOLDOWN_S):
        calls.append((autoscale, cooldown_s))
        w = {"minute": 0, "requests": 10, "failed": 0, "lost": 0, "ttft_p90_s": 1.0, "itl_p90_s": 0.01, "met": True}
        return {"windows": [w], "worker_hours": 1.5, "requests": 10, "failed": 0, "lost_with_killed": 0,
                "autoscaler": {"reversals_within_10min": 0}}
    monkeypatch.setattr(S, "run_one", fake_run)
    monkeypatch.setattr(S, "_layout_at", lambda s, t: (1, 1))
    monkeypatch.setattr(S, "trace", lambda s, path, seed=7: 0)
    assert S.main(["step", "--cooldown", "0", "--no-baseline", "--seeds", "2", "--out", str(tmp_path)]) == 0
    assert calls == [(True, 0.0), (True, 0.0)]  # two traces, autoscaled, cool-down 0; no static run
    row = json.loads((tmp_path / "scenarios.json").read_text())[0]
    assert row["static_baseline"] is None and row["worker_hours_vs_static"] is None and row["cooldown_s"] == 0.0
    assert "cool-down 0 s" in S.table([row]) and "not searched" in S.table([row])


def test_scenarios_refuse_a_negative_cooldown(capsys):
    assert S.main(["step", "--cooldown", "-1"]) == 2
    assert "--cooldown must be >= 0" in capsys.readouterr().err
