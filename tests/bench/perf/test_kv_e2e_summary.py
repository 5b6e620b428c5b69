"""`pdserve bench kv --e2e`'s verdicts from its runs (pure: no engines)."""

import pytest

from bench.perf.kv.e2e import spread, summarize


def row(waits, nbytes=None):
    """A mode's repeats whose KV wait p50 and mean are both `waits` (ms)."""
    return {"kv_wait_p50_ms_by_repeat": waits, "kv_wait_p50_ms": spread(waits), "kv_wait_mean_ms_by_repeat": waits,
            "bytes_moved": nbytes}


def test_targets_are_read_per_repeat():
    runs = {"push-bf16": row([10, 11, 10, 12, 10], 200), "pull-bf16": row([12, 11, 16, 13, 20], 200),
            "nixl-bf16": row([11, 12, 10, 13, 11], 200),
            "push-fp8": row([8, 8, 9, 8, 8], 100), "pull-fp8": row([9, 7, 9, 9, 9], 100)}
    s = summarize(runs, ("bf16", "fp8"))
    assert s["push_le_pull_every_repeat_bf16"] is True
    assert s["push_le_pull_every_repeat_fp8"] is False  # repeat 2: 8 > 7
    assert s["push_spread_over_pull_spread_bf16"] == pytest.approx(2 / 9)
    assert s["push_over_pull_p50_bf16"] == pytest.approx(10 / 13)
    assert s["push_over_nixl_max_bf16"] == pytest.approx(1.0)  # 10/10 in repeat 3
    assert s["pull_over_nixl_max_bf16"] == pytest.approx(20 / 11)
    assert s["fp8_over_bf16_bytes_push"] == s["fp8_over_bf16_bytes_pull"] == 0.5
    assert "fp8_over_bf16_bytes_nixl" not in s and "push_over_nixl_max_fp8" not in s
    assert spread([3, 1, 2]) == {"min": 1, "median": 2, "max": 3, "spread": 2}


def test_a_row_holds_per_request_waits_or_a_servers_mean():
    from bench.perf.kv.e2e import _row

    ours = _row([[(0.2, 0.010), (0.3, 0.030), (0.25, 0.020)], [(0.2, 0.05), (0.2, 0.07)]], 64.0)
    assert ours["kv_wait_p50_ms_by_repeat"] == pytest.approx([20.0, 60.0])
    assert ours["kv_wait_mean_ms_by_repeat"] == pytest.approx([20.0, 60.0])
    assert ours["p50_ms_by_repeat"] == pytest.approx([250.0, 200.0]) and ours["bytes_moved"] == 64.0
    theirs = _row([[(0.4, None), (0.5, None), ("mean", 0.012)]], None)
    assert theirs["kv_wait_mean_ms_by_repeat"] == pytest.approx([12.0]) and theirs["kv_wait_p50_ms"] is None
    assert theirs["p50_ms_by_repeat"] == pytest.approx([450.0])
