"""The soak's verdict from its samples (pure functions; the soak itself is a benchmark)."""

import argparse

from bench.perf.soak import Tally, _report, is_flat, trend_mib_per_h


def samples(series: dict[str, list[float]], t0: float = 100.0, step: float = 10.0) -> list[dict]:
    n = len(next(iter(series.values())))
    idle = {"w": {"active": 0, "held": 0.0, "active_requests": 0}}
    return [{"t": t0 + i * step, "rss_mib": {k: v[i] for k, v in series.items()}, "blocks": idle} for i in range(n)]


def args() -> argparse.Namespace:
    return argparse.Namespace(duration=300, concurrency=2, prefill=1, decode=1, abort_fraction=0.3,
                              rss_growth_limit=3.0)


def test_trend_is_the_least_squares_slope_per_hour():
    assert trend_mib_per_h([0, 10, 20, 30], [100, 101, 102, 103]) == 360.0
    assert trend_mib_per_h([0], [5]) == 0.0
    assert trend_mib_per_h([0, 10], [7, 7]) == 0.0


def test_flat_allows_noise_and_a_small_percentage_only():
    assert is_flat(2300, 2330, 3.0)       # +30 MiB: noise
    assert is_flat(2300, 2368, 3.0)       # +2.96%
    assert not is_flat(2300, 2506, 3.0)   # +8.9%: what glibc's retained chunks did to a prefill worker
    assert is_flat(12, 40, 3.0)           # a small process: +28 MiB is noise, not 233%


def test_report_fails_a_climbing_process_and_passes_a_sawtooth():
    climbing = [2300 + 6 * i for i in range(40)]
    sawtooth = [2300 + (i % 3) * 10 for i in range(40)]
    r = _report(args(), Tally(by_kind={"stream": 10}), samples({"p": climbing, "d": sawtooth}), t0=100.0)
    assert r["rss"]["p"]["flat"] is False and r["rss"]["d"]["flat"] is True
    assert r["rss"]["p"]["trend_mib_per_h"] > 2000
    assert r["rss_flat"] is False and r["ok"] is False
    r = _report(args(), Tally(by_kind={"stream": 10}), samples({"d": sawtooth}), t0=100.0)
    assert r["ok"] is True and not r["leaked_blocks"]
