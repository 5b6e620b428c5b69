"""`pdserve bench kv --e2e`'s verdicts from its runs (pure: no engines)."""

import pytest

from bench.perf.kv.e2e import spread, summarize


def row(p50s, nbytes=None):
    return {"p50_ms_by_repeat": p50s, "p50_ms": spread(p50s), "bytes_moved": nbytes}


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
